//! The tcp ports clients reach besides `--listen` (the NIC serving lock
//! memory and slots), kept in the state
//! directory's `ports` file so that a restarted meta-server binds them
//! again: a client's connections and the lock areas it holds name them, and
//! it reconnects to the same address after the restart. A port given
//! explicitly wins; a remembered port that is taken now is replaced by a
//! new one (clients that named the old one then cannot reclaim, and must
//! be mounted again).
//!
//! The file holds one `NAME PORT` line per port.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::journal::files::PORTS;

/// The NIC serving lock memory and attribute slots.
pub(super) const NIC: &str = "nic";

/// The ports of the state directory.
pub(super) struct StablePorts {
    path: PathBuf,
    ports: BTreeMap<String, u16>,
}

impl StablePorts {
    /// What `dir`'s `ports` file remembers (nothing if it has none, or a
    /// line is not `NAME PORT`: such a line is ignored).
    pub fn load(dir: &Path) -> Self {
        let path = dir.join(PORTS);
        let ports = std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let (name, port) = line.split_once(' ')?;
                Some((name.to_string(), port.trim().parse().ok()?))
            })
            .collect();
        Self { path, ports }
    }

    /// Where to bind `name`: `configured`, with the remembered port when
    /// its port is 0.
    pub fn wanted(&self, name: &str, configured: SocketAddr) -> SocketAddr {
        match (configured.port(), self.ports.get(name)) {
            (0, Some(&port)) => SocketAddr::new(configured.ip(), port),
            _ => configured,
        }
    }

    /// Binds `name` with `bind`: at the remembered port first, then, if
    /// that fails, where `configured` says. Remembers the port bound.
    pub fn bind<T, E: std::fmt::Display>(
        &mut self,
        name: &str,
        configured: SocketAddr,
        mut bind: impl FnMut(SocketAddr) -> Result<T, E>,
        port_of: impl Fn(&T) -> u16,
    ) -> Result<T, E> {
        let wanted = self.wanted(name, configured);
        let bound = match bind(wanted) {
            Err(e) if wanted != configured => {
                log::warn!(
                    "cannot bind {name} at {wanted} again ({e}); clients of the previous process that \
                     reach it there must be mounted again"
                );
                bind(configured)
            }
            bound => bound,
        }?;
        self.ports.insert(name.to_string(), port_of(&bound));
        Ok(bound)
    }

    /// Writes the file.
    pub fn save(&self) -> std::io::Result<()> {
        let text: String = self.ports.iter().map(|(name, port)| format!("{name} {port}\n")).collect();
        std::fs::write(&self.path, text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_binds_the_ports_it_bound_before() {
        let dir = tempfile::tempdir().unwrap();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let listen = |a: SocketAddr| std::net::TcpListener::bind(a);
        let port_of = |l: &std::net::TcpListener| l.local_addr().unwrap().port();
        let mut first = StablePorts::load(dir.path());
        let nic = first.bind(NIC, any, listen, port_of).unwrap();
        let port = port_of(&nic);
        first.save().unwrap();
        drop(nic);

        let mut again = StablePorts::load(dir.path());
        assert_eq!(again.wanted(NIC, any).port(), port);
        assert_eq!(port_of(&again.bind(NIC, any, listen, port_of).unwrap()), port);
        let fixed: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(again.wanted(NIC, fixed), fixed, "a port given explicitly wins");

        // Taken meanwhile: another port, remembered from now on.
        let squatter = std::net::TcpListener::bind(SocketAddr::new(any.ip(), port)).unwrap();
        let moved = again.bind(NIC, any, listen, port_of).unwrap();
        assert_ne!(port_of(&moved), port);
        again.save().unwrap();
        drop(squatter);
        assert_eq!(StablePorts::load(dir.path()).wanted(NIC, any).port(), port_of(&moved));
    }

    #[test]
    fn a_garbled_file_remembers_nothing() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(PORTS), "nic notaport\nlock-host\n").unwrap();
        let ports = StablePorts::load(dir.path());
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        assert_eq!(ports.wanted(NIC, any), any);
        assert_eq!(ports.wanted("lock-host", any), any);
    }
}
