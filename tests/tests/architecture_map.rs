//! ARCHITECTURE.md names crates, modules and files in backticks; this test
//! checks that every one of them exists, so the map cannot rot silently
//! (it runs with the workspace's tests, which CI's `.ci/run` runs).
//!
//! What counts as a name (fenced code blocks are skipped, and so is any
//! span with a space in it, which is a command or a value):
//! - a relative path with a `/` (`meta-server/src/grants.rs`,
//!   `dist/systemd/`): it must exist under the workspace root (absolute
//!   paths such as `/dev/shm` are the host's, and paths that leave the
//!   repository such as `../shared/DESIGN.md` are beside its checkout:
//!   neither is checked, a clone has no say in them);
//! - a Rust path of a workspace crate (`fs::locks`, `citron_lock::rdma`,
//!   `meta_server::service::status`): each lower-case segment must be a
//!   module file of the crate (`NAME.rs` or `NAME/mod.rs`), except that the
//!   last may be a function of the module before it; a segment in
//!   `CamelCase` (or `UPPER_CASE`) is an item that must be declared in
//!   that module;
//! - a package name (`citronfs-core`, `citron-lock`): it must be a member
//!   of the workspace.

use std::path::{Path, PathBuf};

/// The workspace root (the tests crate is one of its members).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

/// The spans in backticks outside fenced code blocks.
fn spans(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut parts = line.split('`');
        parts.next();
        while let (Some(inside), Some(_)) = (parts.next(), parts.next()) {
            out.push(inside.to_string());
        }
        // An unpaired last backtick opens nothing (`split` leaves it).
    }
    out
}

/// The workspace's crates: (package name, Rust name, source directory).
fn crates(root: &Path) -> Vec<(String, String, PathBuf)> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("the workspace manifest");
    let members = manifest
        .split("members = [")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .expect("the workspace's members");
    members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|dir| {
            let text =
                std::fs::read_to_string(root.join(dir).join("Cargo.toml")).expect("a member's manifest");
            let name = text
                .lines()
                .find_map(|l| l.strip_prefix("name = "))
                .map(|n| n.trim().trim_matches('"').to_string())
                .expect("a package name");
            (name.clone(), name.replace('-', "_"), root.join(dir).join("src"))
        })
        .collect()
}

/// The source directory of the crate a Rust path starts with: its Rust
/// name (`citronfs_core`) or its folder (`fs`, `meta_server`).
fn crate_dir(crates: &[(String, String, PathBuf)], root: &Path, first: &str) -> Option<PathBuf> {
    crates.iter().find_map(|(_, rust, src)| {
        let folder = src.parent()?.strip_prefix(root).ok()?.to_str()?.replace('-', "_");
        (rust == first || folder == first).then(|| src.clone())
    })
}

/// The file of module `dir`/`name`.
fn module_file(dir: &Path, name: &str) -> Option<PathBuf> {
    [dir.join(format!("{name}.rs")), dir.join(name).join("mod.rs")].into_iter().find(|p| p.is_file())
}

fn is_rust_path(span: &str) -> bool {
    span.contains("::")
        && span.split("::").all(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
}

fn declares(file: &Path, item: &str) -> bool {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    ["struct", "enum", "trait", "type", "fn", "const", "static", "mod", "use"]
        .iter()
        .any(|kw| text.contains(&format!("{kw} {item}")))
        || text.contains(&format!("{item},"))
        || text.contains(&format!("::{item};"))
        || text.contains(&format!("{item}}}"))
}

/// Every `.rs` file of the workspace's crates.
fn sources(crates: &[(String, String, PathBuf)]) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    for (_, _, src) in crates {
        walk(src, &mut out);
    }
    out
}

/// Checks `Type::member` (a method, a variant, an associated item): the
/// type is declared in some file of the workspace, and a file that
/// declares or implements it names the member.
fn check_type_path(crates: &[(String, String, PathBuf)], span: &str) -> Result<(), String> {
    let segments: Vec<&str> = span.split("::").collect();
    let ty = segments[0];
    let texts: Vec<String> = sources(crates).iter().filter_map(|f| std::fs::read_to_string(f).ok()).collect();
    let declares_type =
        |t: &String| ["struct", "enum", "trait", "type"].iter().any(|kw| t.contains(&format!("{kw} {ty}")));
    if !texts.iter().any(declares_type) {
        return Err(format!("`{span}`: no type `{ty}` in the workspace"));
    }
    let Some(member) = segments.get(1) else { return Ok(()) };
    let about_type =
        |t: &&String| declares_type(t) || t.contains(&format!(" {ty} {{")) || t.contains(&format!(" {ty}<"));
    let names = |t: &&String| {
        [
            format!("fn {member}"),
            format!("{member}("),
            format!("{member},"),
            format!("{member} {{"),
            format!("const {member}"),
        ]
        .iter()
        .any(|p| t.contains(p.as_str()))
    };
    if texts.iter().filter(about_type).any(|t| names(&t)) {
        Ok(())
    } else {
        Err(format!("`{span}`: `{ty}` has no `{member}`"))
    }
}

/// Checks one Rust path; the reason it does not exist, if it does not.
fn check_rust_path(crates: &[(String, String, PathBuf)], root: &Path, span: &str) -> Result<(), String> {
    let segments: Vec<&str> = span.split("::").collect();
    if segments[0].chars().next().is_some_and(|c| c.is_ascii_uppercase()) {
        return check_type_path(crates, span);
    }
    let Some(src) = crate_dir(crates, root, segments[0]) else {
        return Err(format!("`{span}`: no crate `{}` in the workspace", segments[0]));
    };
    // The crate root, then each module.
    let mut file = ["lib.rs", "main.rs"].iter().map(|f| src.join(f)).find(|p| p.is_file());
    let mut dir = src.clone();
    for (i, seg) in segments.iter().enumerate().skip(1) {
        let Some(current) = file.clone() else { break };
        let item = seg.chars().next().is_some_and(|c| c.is_ascii_uppercase());
        if item {
            if !declares(&current, seg) {
                return Err(format!("`{span}`: `{seg}` is not declared in {}", current.display()));
            }
            return Ok(());
        }
        match module_file(&dir, seg) {
            Some(f) => {
                dir = dir.join(seg);
                file = Some(f);
            }
            None if i == segments.len() - 1 && declares(&current, seg) => return Ok(()),
            None => return Err(format!("`{span}`: no module `{seg}` in {}", dir.display())),
        }
    }
    Ok(())
}

/// Every name of `markdown` that does not exist in the workspace at
/// `root`, with why.
fn missing(markdown: &str, root: &Path) -> Vec<String> {
    let crates = crates(root);
    let mut problems = Vec::new();
    for span in spans(markdown) {
        let span = span.trim();
        if span.is_empty() || span.contains(char::is_whitespace) {
            continue;
        }
        if is_rust_path(span) {
            if let Err(e) = check_rust_path(&crates, root, span) {
                problems.push(e);
            }
        } else if span.contains('/')
            && !span.starts_with('/')
            && !span.starts_with("../")
            && !span.contains("://")
            && !span.contains(':')
        {
            if !root.join(span).exists() {
                problems.push(format!("`{span}`: no such file or directory"));
            }
        } else if (span.starts_with("citron-") || span.starts_with("citronfs-"))
            && span.chars().all(|c| c.is_ascii_lowercase() || c == '-')
            && !crates.iter().any(|(name, _, _)| name == span)
        {
            problems.push(format!("`{span}`: no such crate in the workspace"));
        }
    }
    problems
}

#[test]
fn every_name_in_the_architecture_map_exists() {
    let root = root();
    let map = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let problems = missing(&map, &root);
    assert!(problems.is_empty(), "ARCHITECTURE.md names what does not exist:\n{}", problems.join("\n"));
    // It names something: a parser that found nothing would pass any map.
    assert!(spans(&map).len() > 50, "ARCHITECTURE.md names almost nothing");
}

#[test]
fn the_checker_refuses_what_does_not_exist() {
    let root = root();
    let good = "The `fs::locks` module, `fs::locks::protocol`, `meta-server/src/grants.rs`, `dist/systemd/`,\n\
                the crate `citronfs-core`, `citron_lock::rdma::tcp`, the item `fs::locks::area::LockArea`,\n\
                the function `mount::errno`, the method `FsClient::read`, the variant `FsError::Fenced`, a command `citronfs status`,\n\
                a host path `/dev/log` and a path beside the checkout `../shared/papers/`.";
    assert_eq!(missing(good, &root), Vec::<String>::new());
    for bad in [
        "`meta-server/src/no_such_file.rs`",
        "`fs::no_such_module`",
        "`fs::locks::NoSuchItem`",
        "`no_such_crate::x`",
        "`citronfs-nonesuch`",
        "`tools/src/gone/`",
        "`lock::rdma::tcp::no_such_fn`",
        "`NoSuchType::read`",
        "`FsClient::no_such_method`",
    ] {
        let found = missing(&format!("Some text {bad} and more."), &root);
        assert_eq!(found.len(), 1, "{bad}: {found:?}");
    }
    // Names in fenced code blocks are examples, not claims.
    assert!(missing("```\n`fs::no_such_module`\n```\n", &root).is_empty());
    assert_eq!(spans("a `b` c `d e` f"), vec!["b".to_string(), "d e".to_string()]);
}
