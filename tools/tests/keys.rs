//! Cluster keys at the command line, where a hole once was: an
//! embedded `citronfs mount` serving a file, and `citronfs bench verbs`
//! pointed at every port the mount listens on. With keys it is refused at
//! each and the file's bytes are unchanged; a second mount joins only with
//! the key file the first one printed.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_citronfs");

/// A `citronfs mount` child, unmounted (SIGINT, then lazily) on drop.
struct Mount {
    child: Child,
    dir: tempfile::TempDir,
    lines: Vec<String>,
}

impl Mount {
    /// Starts `citronfs mount DIR extra...` and reads what it prints until
    /// the line that starts with `until` (or its first line if none).
    fn start(extra: &[&str], until: Option<&str>) -> Result<Self, String> {
        Self::start_in(None, extra, until)
    }

    /// As [`Mount::start`], with `runtime` as its XDG_RUNTIME_DIR (where an
    /// embedded cluster's key file goes).
    fn start_in(
        runtime: Option<&std::path::Path>,
        extra: &[&str],
        until: Option<&str>,
    ) -> Result<Self, String> {
        let dir = tempfile::tempdir().unwrap();
        let mut command = Command::new(EXE);
        if let Some(runtime) = runtime {
            command.env("XDG_RUNTIME_DIR", runtime);
        }
        let mut child = command
            .arg("mount")
            .arg(dir.path())
            .arg("--foreground")
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut lines = Vec::new();
        loop {
            match out.next() {
                Some(Ok(l)) => {
                    let done = until.is_none_or(|u| l.starts_with(u));
                    lines.push(l);
                    if done {
                        break;
                    }
                }
                _ => {
                    let mut err = String::new();
                    let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err);
                    let _ = child.wait();
                    return Err(err);
                }
            }
        }
        Ok(Self { child, dir, lines })
    }

    fn path(&self, rel: &str) -> std::path::PathBuf {
        self.dir.path().join(rel)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("fusermount3").arg("-uz").arg(self.dir.path()).output();
    }
}

/// The TCP ports process `pid` listens on (from `ss`, Debian's iproute2).
fn listening(pid: u32) -> Vec<SocketAddr> {
    let out = Command::new("ss").args(["-Hltnp"]).output().expect("ss (iproute2)");
    let text = String::from_utf8_lossy(&out.stdout);
    let tag = format!("pid={pid},");
    text.lines()
        .filter(|l| l.contains(&tag))
        .filter_map(|l| l.split_whitespace().nth(3)?.parse().ok())
        .collect()
}

#[test]
fn raw_verbs_against_a_keyed_mounts_ports_are_refused_and_change_nothing() {
    let first = Mount::start(&[], Some("  citronfs data-server")).expect("embedded mount");
    let text = first.lines.join("\n");
    let meta = text
        .split("(meta-server ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .expect("the meta-server's address")
        .to_string();
    let key_file = text
        .lines()
        .find_map(|l| l.strip_prefix("cluster key: "))
        .and_then(|r| r.split(" (").next())
        .expect("the key file")
        .to_string();
    assert!(text.contains(&format!("--key-file {key_file}")), "{text}");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    let content = vec![b'S'; 64 * 1024];
    std::fs::write(first.path("f"), &content).unwrap();

    let ports = listening(first.child.id());
    assert!(ports.len() >= 4, "meta RPC, NICs and lock services: {ports:?}");
    for port in &ports {
        let out = Command::new(EXE)
            .args(["bench", "verbs", "--backend", "tcp", "--threads", "1", "--ops", "50", "--fabric"])
            .arg(format!("tcp:{port}"))
            .arg("--out")
            .arg(first.dir.path().join("no-such-dir"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "bench verbs against {port} ran:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(err.contains("requires a key"), "{port}: {err}");
    }
    assert_eq!(std::fs::read(first.path("f")).unwrap(), content, "the file is unchanged");

    // Another mount: refused without the key, served with it.
    let err = Mount::start(&["--meta", &meta, "--transport", "tcp", "--timeout", "3"], None)
        .err()
        .expect("a mount without the key is refused");
    assert!(err.contains("requires a key"), "{err}");
    let second = Mount::start(&["--meta", &meta, "--transport", "tcp", "--key-file", &key_file], None)
        .expect("joins with the key");
    assert_eq!(std::fs::read(second.path("f")).unwrap(), content);
    std::fs::write(second.path("g"), b"from the second mount").unwrap();
    assert_eq!(std::fs::read(first.path("g")).unwrap(), b"from the second mount");
    drop(second);
    drop(first);
    assert!(!std::path::Path::new(&key_file).exists(), "the embedded cluster's key goes with it");
}

#[test]
fn servers_reachable_from_other_hosts_refuse_to_start_without_a_key() {
    for args in [
        vec!["meta-server", "--listen", "0.0.0.0:0"],
        vec!["data-server", "--listen", "0.0.0.0:0", "--meta", "127.0.0.1:1"],
        vec!["region-host", "--listen", "0.0.0.0:0"],
    ] {
        let out = Command::new(EXE).args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(err.contains("has no key") && err.contains("citronfs key new"), "{args:?}: {err}");
    }
}

#[test]
fn key_new_writes_a_private_file_and_never_overwrites() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lab.key");
    let run =
        |extra: &[&str]| Command::new(EXE).args(["key", "new"]).arg(&path).args(extra).output().unwrap();
    let out = run(&["--name", "lab", "--role", "client", "--squash", "root"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.lines().any(|l| l.starts_with("lab ") && l.ends_with("role=client squash=root")), "{text}");
    assert!(!run(&[]).status.success(), "overwrote an existing key file");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
    // An exposed key file is refused by the servers.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = Command::new(EXE)
        .args(["meta-server", "--listen", "127.0.0.1:0", "--key-file"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("chmod 600"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An embedded mount killed outright cannot remove its key file; the next
/// mount on the host does, and leaves a running mount's alone.
#[test]
fn a_killed_mounts_key_file_is_removed_by_the_next_mount() {
    let runtime = tempfile::tempdir().unwrap();
    let key_of = |m: &Mount| {
        let line =
            m.lines.iter().find_map(|l| l.strip_prefix("cluster key: ")).expect("a key line").to_string();
        std::path::PathBuf::from(line.split(" (").next().unwrap())
    };
    let running = Mount::start_in(Some(runtime.path()), &[], Some("cluster key:")).unwrap();
    let mut killed = Mount::start_in(Some(runtime.path()), &[], Some("cluster key:")).unwrap();
    let (running_key, killed_key) = (key_of(&running), key_of(&killed));
    assert!(killed_key.starts_with(runtime.path()), "{}", killed_key.display());
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    assert!(killed_key.exists(), "a killed mount cannot remove its own key file");
    let next = Mount::start_in(Some(runtime.path()), &[], Some("cluster key:")).unwrap();
    assert!(!killed_key.exists(), "the next mount removes the key file of a process that is gone");
    assert!(running_key.exists(), "a running mount's key file stays");
    assert!(key_of(&next).exists());
    drop(next);
    drop(running);
    drop(killed);
}
