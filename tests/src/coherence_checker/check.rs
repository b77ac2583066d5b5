//! The oracle's verdict on one look: the states it may show (from the
//! last one whose change had ended before it began to the last one whose
//! change had begun before it ended), the walks of its path through them,
//! and what it may have seen at the end of each.

use std::collections::{BTreeMap, BTreeSet};

use super::model::{split, Body, Ino, Obj, Resolved, DIR_PERM};
use super::{Look, Observation, Seen, SeenAttr, Version};

/// What `look` shows of object `obj` (the look having found it by name).
fn shows(look: Look, obj: &Obj, nlink_now: Option<u32>) -> Seen {
    match (&obj.body, look) {
        (_, Look::Exists) => Seen::Done,
        (Body::File { perm, .. }, Look::Exec) if perm & 0o111 == 0 => Seen::Err(libc::EACCES),
        (_, Look::Exec) => Seen::Done,
        (Body::File { content, .. }, Look::Read) => Seen::Bytes(content.clone()),
        (Body::Dir { .. }, Look::Read) => Seen::Err(libc::EISDIR),
        (Body::Symlink { target }, Look::Readlink) => Seen::Target(target.clone()),
        (_, Look::Readlink) => Seen::Err(libc::EINVAL),
        (Body::Dir { children }, Look::Readdir) => Seen::Names(children.keys().cloned().collect()),
        (_, Look::Readdir) => Seen::Err(libc::ENOTDIR),
        (body, Look::Stat | Look::Lstat) => {
            let (kind, perm, size, nlink) = match body {
                Body::File { content, perm, .. } => {
                    ('f', *perm, content.len() as u64, nlink_now.unwrap_or(0))
                }
                Body::Dir { .. } => ('d', DIR_PERM, 0, 0),
                Body::Symlink { target } => ('l', 0o777, target.len() as u64, 1),
            };
            Seen::Attr(SeenAttr { kind, ino: obj.ino, perm, size, nlink: nlink as u64, mtime: (0, 0) })
        }
        (Body::Symlink { .. }, Look::Read) => unreachable!("a read follows symlinks"),
    }
}

/// Whether `seen` is what `look` shows of `obj`: the mtime by its rule,
/// and of a directory neither its size nor its link count.
fn agrees(look: Look, obj: &Obj, nlink_now: Option<u32>, seen: &Seen) -> bool {
    let expected = shows(look, obj, nlink_now);
    match (&expected, seen) {
        (Seen::Attr(e), Seen::Attr(s)) => {
            let same = e.kind == s.kind && e.ino == s.ino;
            match &obj.body {
                Body::File { mtime, .. } => {
                    same && e.perm == s.perm
                        && e.size == s.size
                        && e.nlink == s.nlink
                        && mtime.matches(s.mtime)
                }
                Body::Dir { .. } => same && e.perm == s.perm,
                Body::Symlink { .. } => same && e.size == s.size,
            }
        }
        _ => expected == *seen,
    }
}

/// The most symlinks one walk follows (Linux's `MAXSYMLINKS`).
const MAX_SYMLINKS: u32 = 40;

/// Where the walk of `path` through `states` may end: what it found (or
/// the errno) and the state its last step read. Each step of a walk (a
/// name looked up, a symlink followed) reads one state, no older than the
/// one the step before it read.
fn walks(states: &[Version], path: &str, follow: bool) -> BTreeSet<(Resolved, usize)> {
    let (dirs, name) = split(path);
    let root = states[0].tree.root;
    let mut out = BTreeSet::new();
    if name.is_empty() {
        out.insert((Ok(root), 0));
        return out;
    }
    let mut at: BTreeSet<(Ino, usize)> = BTreeSet::from([(root, 0)]);
    for component in dirs {
        let mut next = BTreeSet::new();
        for &(dir, from) in &at {
            for (i, v) in states.iter().enumerate().skip(from) {
                match v.tree.children(dir).and_then(|c| c.get(component)) {
                    None => out.insert((Err(libc::ENOENT), i)),
                    Some(sub) if v.tree.children(*sub).is_some() => next.insert((*sub, i)),
                    Some(_) => out.insert((Err(libc::ENOTDIR), i)),
                };
            }
        }
        at = next;
    }
    // The last name, and the symlinks it leads through (targets are
    // names in the same directory).
    let mut todo: Vec<(Ino, String, usize, u32)> =
        at.into_iter().map(|(dir, from)| (dir, name.to_string(), from, 0)).collect();
    let mut done = BTreeSet::new();
    while let Some(step) = todo.pop() {
        if !done.insert(step.clone()) {
            continue;
        }
        let (dir, name, from, followed) = step;
        for (i, v) in states.iter().enumerate().skip(from) {
            match v.tree.children(dir).and_then(|c| c.get(&name)) {
                None => {
                    out.insert((Err(libc::ENOENT), i));
                }
                Some(found) => {
                    // A request about the inode it found (a getattr, a
                    // readlink, an open) reads a later state, which may
                    // no longer have it.
                    if let Some(gone) = states[i..].iter().position(|v| !v.tree.objects.contains_key(found)) {
                        out.insert((Err(libc::ENOENT), i + gone));
                    }
                    match &v.tree.objects[found].body {
                        Body::Symlink { target } if follow => match followed {
                            MAX_SYMLINKS => {
                                out.insert((Err(libc::ELOOP), i));
                            }
                            _ => todo.push((dir, target.clone(), i, followed + 1)),
                        },
                        _ => {
                            out.insert((Ok(*found), i));
                        }
                    }
                }
            }
        }
    }
    out
}

/// Whether `names`, a listing of directory `dir` opened in `states[0]`,
/// is one a listing made while `states` followed one another may be:
/// every name that kept its entry through all of them once, and nothing
/// but names the directory had in one of them (a name that changed
/// during the listing may be missed or listed twice).
fn listing_agrees(states: &[Version], dir: Ino, names: &[String]) -> bool {
    let entries: Vec<&BTreeMap<String, Ino>> = states.iter().filter_map(|v| v.tree.children(dir)).collect();
    let Some(first) = entries.first() else { return false };
    let kept = |name: &str| {
        let entry = first.get(name);
        entry.is_some() && entries.iter().all(|e| e.get(name) == entry)
    };
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for n in names {
        *counts.entry(n).or_default() += 1;
    }
    first.keys().all(|n| !kept(n) || counts.get(n.as_str()) == Some(&1))
        && counts
            .iter()
            .all(|(n, count)| entries.iter().any(|e| e.contains_key(*n)) && (*count == 1 || !kept(n)))
}

/// Checks observation `o` against its zone's log: `None` if it shows an
/// allowed state, else what went wrong.
pub(super) fn check(versions: &[Version], o: &Observation) -> Option<String> {
    // The last state whose change had ended before the look began, and the
    // last whose change had begun before it ended.
    let first = versions.partition_point(|v| v.end <= o.start).saturating_sub(1);
    let last = versions.partition_point(|v| v.start <= o.end).saturating_sub(1).max(first);
    let candidates = &versions[first..=last];
    let follow = !matches!(o.look, Look::Lstat | Look::Readlink);
    for (found, i) in walks(candidates, &o.path, follow) {
        let ino = match found {
            Err(e) if o.seen == Seen::Err(e) => return None,
            Err(_) => continue,
            Ok(ino) => ino,
        };
        if let (Look::Readdir, Seen::Names(names)) = (o.look, &o.seen) {
            if listing_agrees(&candidates[i..], ino, names) {
                return None;
            }
            continue;
        }
        // The object as that state and every later one has it (one no
        // longer named keeps what it had, with no links).
        let mut obj = &candidates[i].tree.objects[&ino];
        for later in &candidates[i..] {
            let nlink_now = match later.tree.objects.get(&ino) {
                Some(now) => {
                    obj = now;
                    match now.body {
                        Body::File { nlink, .. } => Some(nlink),
                        _ => None,
                    }
                }
                None => None,
            };
            if agrees(o.look, obj, nlink_now, &o.seen) {
                return None;
            }
        }
    }
    let newest = &versions[first];
    let expected: Vec<String> = candidates
        .iter()
        .map(|v| match v.tree.resolve(&o.path, follow) {
            Err(e) => format!("errno {e}"),
            Ok(ino) => {
                let obj = &v.tree.objects[&ino];
                let nlink = match obj.body {
                    Body::File { nlink, .. } => Some(nlink),
                    _ => None,
                };
                format!("{:?}", shows(o.look, obj, nlink))
            }
        })
        .collect();
    let recent: Vec<&str> = versions[..=last].iter().rev().take(8).map(|v| v.by.as_str()).collect();
    Some(format!(
        "{:?} of zone{}/{} began {:?} after the last change before it had returned ({}) and took {:?}; saw {:?}, \
         expected one of {:?} ({} states could overlap it); the changes up to the last that could, newest \
         first: {recent:?}",
        o.look,
        o.zone,
        o.path,
        o.start.duration_since(newest.end),
        newest.by,
        o.end.duration_since(o.start),
        o.seen,
        expected,
        candidates.len()
    ))
}
