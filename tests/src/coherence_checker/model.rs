//! The oracle's model of one zone of the checked tree: every name, what it
//! is and what a change does to it. A change is applied to a copy
//! ([`Tree::apply`]), which answers `None` when the file system must
//! refuse it; what an observation may show is computed from the model too
//! ([`Tree::resolve`], [`Obj`]).
//!
//! Objects are keyed by their real inode numbers (the file system never
//! hands one out twice), so an observation's inode is checked as well.

use std::collections::{BTreeMap, BTreeSet};

/// An inode number: the key of an object.
pub type Ino = u64;

/// The names a directory may hold: directories only.
pub const DIR_NAMES: [&str; 3] = ["a", "b", "c"];
/// The names of files, hard links and symlinks (never directories).
pub const FILE_NAMES: [&str; 4] = ["f0", "f1", "f2", "f3"];

/// The seconds of the mtimes a `utime` sets are `UTIME_BASE + n`, far from
/// any time a write stamps: an mtime in that range is one a `utime` set.
pub const UTIME_BASE: i64 = 1_000_000_000;
const UTIME_SPAN: i64 = 100_000_000;

/// What a file's mtime may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mtime {
    /// The time the last `utime` set, if nothing since has surely changed
    /// it.
    pub set: Option<(i64, u32)>,
    /// Whether a write or truncate since may have stamped it with the
    /// time of day.
    pub stamped: bool,
}

impl Mtime {
    pub fn matches(&self, (secs, nsec): (i64, u32)) -> bool {
        let from_utime = (UTIME_BASE..UTIME_BASE + UTIME_SPAN).contains(&secs);
        self.set == Some((secs, nsec)) || (self.stamped && !from_utime)
    }

    /// After a write or a truncate: the same, or stamped.
    fn touched(self) -> Self {
        Self { set: self.set, stamped: true }
    }
}

/// What an object is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body {
    File { content: Vec<u8>, perm: u32, mtime: Mtime, nlink: u32 },
    Dir { children: BTreeMap<String, Ino> },
    Symlink { target: String },
}

/// One object of the tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Obj {
    pub ino: Ino,
    pub body: Body,
}

/// The perm bits of every directory the checker makes.
pub const DIR_PERM: u32 = 0o755;
/// The perm bits of every file the checker creates.
pub const FILE_PERM: u32 = 0o644;

/// A change the checker makes, with zone-relative paths (`a/b/f0`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Create(String),
    Write { path: String, offset: u64, bytes: Vec<u8> },
    Append { path: String, bytes: Vec<u8> },
    Truncate { path: String, len: u64 },
    Rename { from: String, to: String },
    Link { from: String, to: String },
    Symlink { target: String, path: String },
    Chmod { path: String, perm: u32 },
    Utime { path: String, mtime: (i64, u32) },
    Mkdir(String),
    Rmdir(String),
    Unlink(String),
}

impl Change {
    /// The object a change makes gets its inode number from a look after
    /// it (a stat on the mount that made it): this path, if it makes one.
    pub fn makes(&self) -> Option<&str> {
        match self {
            Change::Create(p) | Change::Mkdir(p) | Change::Symlink { path: p, .. } => Some(p),
            _ => None,
        }
    }
}

/// What a path resolves to, or the errno of the failure.
pub type Resolved = Result<Ino, i32>;

/// One zone's tree: its root directory and every object reachable from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    pub root: Ino,
    pub objects: BTreeMap<Ino, Obj>,
}

/// A path's directories, and its last name (`""` for the root).
pub fn split(path: &str) -> (Vec<&str>, &str) {
    let mut parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let name = parts.pop().unwrap_or("");
    (parts, name)
}

impl Tree {
    /// A zone whose root directory (inode `root`) is empty.
    pub fn empty(root: Ino) -> Self {
        let dir = Obj { ino: root, body: Body::Dir { children: BTreeMap::new() } };
        Self { root, objects: BTreeMap::from([(root, dir)]) }
    }

    /// The entries of directory `dir`, if this state has it.
    pub fn children(&self, dir: Ino) -> Option<&BTreeMap<String, Ino>> {
        match &self.objects.get(&dir)?.body {
            Body::Dir { children } => Some(children),
            _ => None,
        }
    }

    fn children_mut(&mut self, dir: Ino) -> Option<&mut BTreeMap<String, Ino>> {
        match &mut self.objects.get_mut(&dir)?.body {
            Body::Dir { children } => Some(children),
            _ => None,
        }
    }

    /// The directory of `components` (all directories: the checker puts no
    /// symlink where a directory may be).
    fn dir(&self, components: &[&str]) -> Result<Ino, i32> {
        let mut at = self.root;
        for c in components {
            let next = *self.children(at).ok_or(libc::ENOTDIR)?.get(*c).ok_or(libc::ENOENT)?;
            self.children(next).ok_or(libc::ENOTDIR)?;
            at = next;
        }
        Ok(at)
    }

    /// The parent directory of `path` and what its last name holds.
    fn entry(&self, path: &str) -> Result<(Ino, Option<Ino>), i32> {
        let (parents, name) = split(path);
        let parent = self.dir(&parents)?;
        Ok((parent, self.children(parent).and_then(|c| c.get(name)).copied()))
    }

    /// What `path` names (`""`: the zone's root), following a last
    /// symlink if `follow` (targets are names in the same directory).
    pub fn resolve(&self, path: &str, follow: bool) -> Resolved {
        if split(path).1.is_empty() {
            return Ok(self.root);
        }
        let (parent, found) = self.entry(path)?;
        let mut ino = found.ok_or(libc::ENOENT)?;
        let mut seen = BTreeSet::new();
        while let (Body::Symlink { target }, true) = (&self.objects[&ino].body, follow) {
            if !seen.insert(ino) {
                return Err(libc::ELOOP);
            }
            ino = *self.children(parent).expect("a directory").get(target).ok_or(libc::ENOENT)?;
        }
        Ok(ino)
    }

    /// Every path that names something now (the root's as `""`).
    pub fn paths(&self) -> Vec<String> {
        let mut out = vec![String::new()];
        let mut stack = vec![(self.root, String::new())];
        while let Some((dir, prefix)) = stack.pop() {
            for (name, ino) in self.children(dir).into_iter().flatten() {
                let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}/{name}") };
                if self.children(*ino).is_some() {
                    stack.push((*ino, path.clone()));
                }
                out.push(path);
            }
        }
        out
    }

    /// The regular file `path` resolves to (following symlinks).
    pub fn file(&self, path: &str) -> Option<&Obj> {
        let obj = &self.objects[&self.resolve(path, true).ok()?];
        matches!(obj.body, Body::File { .. }).then_some(obj)
    }

    fn file_mut(&mut self, path: &str) -> Option<(&mut Vec<u8>, &mut u32, &mut Mtime)> {
        let ino = self.resolve(path, true).ok()?;
        match &mut self.objects.get_mut(&ino)?.body {
            Body::File { content, perm, mtime, .. } => Some((content, perm, mtime)),
            _ => None,
        }
    }

    /// Drops one name of `ino`, and the object with its last name.
    fn unname(&mut self, ino: Ino) {
        let gone = match &mut self.objects.get_mut(&ino).expect("a named object").body {
            Body::File { nlink, .. } => {
                *nlink -= 1;
                *nlink == 0
            }
            _ => true,
        };
        if gone {
            self.objects.remove(&ino);
        }
    }

    /// Adds the new object `obj` as `path`: its parent must be there and
    /// the name free.
    fn add(&mut self, path: &str, obj: Obj) -> Option<()> {
        let (parent, None) = self.entry(path).ok()? else { return None };
        let ino = obj.ino;
        self.objects.insert(ino, obj);
        self.children_mut(parent)?.insert(split(path).1.to_string(), ino);
        Some(())
    }

    /// The tree after `change`, or `None` if the file system must refuse
    /// it. `made` is the inode number of the object it makes, if any.
    pub fn apply(&self, change: &Change, made: Ino) -> Option<Tree> {
        let mut t = self.clone();
        match change {
            Change::Create(path) => {
                let mtime = Mtime { set: None, stamped: true };
                let body = Body::File { content: Vec::new(), perm: FILE_PERM, mtime, nlink: 1 };
                t.add(path, Obj { ino: made, body })?;
            }
            Change::Mkdir(path) => {
                t.add(path, Obj { ino: made, body: Body::Dir { children: BTreeMap::new() } })?;
            }
            Change::Symlink { target, path } => {
                t.add(path, Obj { ino: made, body: Body::Symlink { target: target.clone() } })?;
            }
            Change::Write { path, offset, bytes } => {
                let (content, _, mtime) = t.file_mut(path)?;
                let (start, end) = (*offset as usize, *offset as usize + bytes.len());
                if content.len() < end {
                    content.resize(end, 0);
                }
                content[start..end].copy_from_slice(bytes);
                *mtime = mtime.touched();
            }
            Change::Append { path, bytes } => {
                let (content, _, mtime) = t.file_mut(path)?;
                content.extend_from_slice(bytes);
                *mtime = mtime.touched();
            }
            Change::Truncate { path, len } => {
                let (content, _, mtime) = t.file_mut(path)?;
                content.resize(*len as usize, 0);
                *mtime = mtime.touched();
            }
            Change::Chmod { path, perm: new } => *t.file_mut(path)?.1 = *new,
            Change::Utime { path, mtime: set } => {
                *t.file_mut(path)?.2 = Mtime { set: Some(*set), stamped: false };
            }
            Change::Unlink(path) => {
                let (parent, Some(ino)) = t.entry(path).ok()? else { return None };
                if t.children(ino).is_some() {
                    return None;
                }
                t.children_mut(parent)?.remove(split(path).1);
                t.unname(ino);
            }
            Change::Rmdir(path) => {
                let (parent, Some(ino)) = t.entry(path).ok()? else { return None };
                if !t.children(ino)?.is_empty() {
                    return None;
                }
                t.children_mut(parent)?.remove(split(path).1);
                t.unname(ino);
            }
            Change::Link { from, to } => {
                let (_, Some(ino)) = t.entry(from).ok()? else { return None };
                let (parent, None) = t.entry(to).ok()? else { return None };
                let Body::File { nlink, .. } = &mut t.objects.get_mut(&ino)?.body else { return None };
                *nlink += 1;
                t.children_mut(parent)?.insert(split(to).1.to_string(), ino);
            }
            Change::Rename { from, to } => t.rename(from, to)?,
        }
        Some(t)
    }

    fn rename(&mut self, from: &str, to: &str) -> Option<()> {
        let (from_parent, Some(moved)) = self.entry(from).ok()? else { return None };
        let (to_parent, replaced) = self.entry(to).ok()?;
        if from == to || replaced == Some(moved) {
            // The same name, or two links of one file: nothing happens.
            return Some(());
        }
        let moving_dir = self.children(moved).is_some();
        if moving_dir {
            // Not into itself: no directory on the way to `to` is the one
            // that moves.
            let mut at = self.root;
            for c in split(to).0 {
                if at == moved {
                    return None;
                }
                at = self.children(at)?[c];
            }
            if at == moved {
                return None;
            }
        }
        if let Some(old) = replaced {
            match self.children(old) {
                Some(c) if !moving_dir || !c.is_empty() => return None,
                None if moving_dir => return None,
                _ => {}
            }
            self.unname(old);
        }
        self.children_mut(from_parent)?.remove(split(from).1);
        self.children_mut(to_parent)?.insert(split(to).1.to_string(), moved);
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_content(t: &Tree, path: &str) -> Vec<u8> {
        match &t.file(path).expect("a file").body {
            Body::File { content, .. } => content.clone(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_model_follows_posix_on_the_changes_it_predicts() {
        let t = Tree::empty(1);
        let t = t.apply(&Change::Mkdir("a".into()), 2).unwrap();
        assert!(t.apply(&Change::Mkdir("a".into()), 3).is_none(), "mkdir of a name in use");
        assert!(t.apply(&Change::Mkdir("b/c".into()), 3).is_none(), "mkdir without a parent");
        let t = t.apply(&Change::Create("a/f0".into()), 3).unwrap();
        let t = t.apply(&Change::Write { path: "a/f0".into(), offset: 2, bytes: b"xy".to_vec() }, 0).unwrap();
        assert_eq!(file_content(&t, "a/f0"), b"\0\0xy");
        let t = t.apply(&Change::Link { from: "a/f0".into(), to: "f1".into() }, 0).unwrap();
        let t = t.apply(&Change::Symlink { target: "f1".into(), path: "f2".into() }, 4).unwrap();
        assert_eq!(t.resolve("f2", true), Ok(3));
        assert_eq!(t.resolve("f2", false), Ok(4));
        assert!(t.apply(&Change::Rmdir("a".into()), 0).is_none(), "rmdir of a full directory");
        // Two links of one file: a rename between them does nothing.
        assert_eq!(t.apply(&Change::Rename { from: "f1".into(), to: "a/f0".into() }, 0), Some(t.clone()));
        assert!(t.apply(&Change::Rename { from: "a".into(), to: "a/b".into() }, 0).is_none(), "into itself");
        let t = t.apply(&Change::Rename { from: "a".into(), to: "b".into() }, 0).unwrap();
        assert_eq!(t.resolve("b/f0", true), Ok(3));
        let t = t.apply(&Change::Unlink("f1".into()), 0).unwrap();
        assert_eq!(t.resolve("f2", true), Err(libc::ENOENT), "a dangling symlink");
        let t = t.apply(&Change::Symlink { target: "f3".into(), path: "f1".into() }, 5).unwrap();
        let t = t.apply(&Change::Symlink { target: "f1".into(), path: "f3".into() }, 6).unwrap();
        assert_eq!(t.resolve("f3", true), Err(libc::ELOOP));
        let t = t.apply(&Change::Mkdir("c".into()), 7).unwrap();
        assert!(
            t.apply(&Change::Rename { from: "c".into(), to: "b".into() }, 0).is_none(),
            "onto a full dir"
        );
        let t = t.apply(&Change::Rename { from: "b".into(), to: "c".into() }, 0).unwrap();
        assert!(!t.objects.contains_key(&7), "the empty directory it replaced is gone");
        assert_eq!(t.file("c/f0").map(|o| o.ino), Some(3));
    }
}
