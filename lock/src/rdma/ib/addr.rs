//! How an `ib` fabric is named: the local RDMA device (and port, and GID
//! index for RoCE) and the host's control address over tcp.
//!
//! `ib:DEVICE@HOST:PORT`, with `DEVICE` one of `mlx5_0`, `mlx5_0:1` (port 1)
//! or `mlx5_0:1:3` (port 1, GID index 3). The device is the one on *this*
//! machine that the node opens; the host part is where the region host's
//! control channel listens (the connection setup of DESIGN.md §3).

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

/// The environment variable that names the device the device-dependent tests
/// run on (`mlx5_0`, `rxe0:1`, ...). Unset: those tests skip and say so.
pub const DEVICE_ENV: &str = "CITRONFS_IB_DEVICE";

/// A local RDMA device, its port and (for RoCE) the GID index to use.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IbDevice {
    /// The device's name under `/sys/class/infiniband` (`mlx5_0`).
    pub name: String,
    /// Physical port, from 1.
    pub port: u8,
    /// GID table index; `None`: the port's LID is used (InfiniBand), or GID
    /// index 0 when the port has no LID (RoCE).
    pub gid_index: Option<u8>,
}

impl IbDevice {
    pub fn new(name: &str) -> Self {
        Self { name: name.to_string(), port: 1, gid_index: None }
    }

    /// The device named by [`DEVICE_ENV`], if the variable is set.
    pub fn from_env() -> Option<Result<IbDevice, String>> {
        let v = std::env::var(DEVICE_ENV).ok()?;
        Some(v.parse())
    }
}

impl FromStr for IbDevice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let name = parts.next().unwrap_or_default();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        {
            return Err(format!("bad RDMA device name {name:?} (e.g. mlx5_0, mlx5_0:1, mlx5_0:1:3)"));
        }
        let port = match parts.next() {
            None => 1,
            Some(p) => match p.parse::<u8>() {
                Ok(p) if p >= 1 => p,
                _ => return Err(format!("bad port {p:?} of RDMA device {name} (a number from 1)")),
            },
        };
        let gid_index = match parts.next() {
            None => None,
            Some(g) => {
                Some(g.parse::<u8>().map_err(|_| format!("bad GID index {g:?} of RDMA device {name}"))?)
            }
        };
        if parts.next().is_some() {
            return Err(format!("RDMA device {s:?} has more than DEVICE:PORT:GID_INDEX"));
        }
        Ok(Self { name: name.to_string(), port, gid_index })
    }
}

impl fmt::Display for IbDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.port)?;
        if let Some(g) = self.gid_index {
            write!(f, ":{g}")?;
        }
        Ok(())
    }
}

/// An `ib` fabric: which local device to open and where the host's control
/// channel listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbFabric {
    pub device: IbDevice,
    pub host: SocketAddr,
}

impl FromStr for IbFabric {
    type Err = String;
    /// `DEVICE@HOST:PORT` (the part after `ib:`).
    fn from_str(s: &str) -> Result<Self, String> {
        let (device, host) =
            s.split_once('@').ok_or_else(|| format!("ib fabric {s:?} is not DEVICE@HOST:PORT"))?;
        use std::net::ToSocketAddrs;
        let host = host
            .to_socket_addrs()
            .map_err(|e| format!("bad ib host address {host:?}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host:?} resolves to nothing"))?;
        Ok(Self { device: device.parse()?, host })
    }
}

impl fmt::Display for IbFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.device, self.host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_forms() {
        assert_eq!("mlx5_0".parse::<IbDevice>().unwrap(), IbDevice::new("mlx5_0"));
        let d: IbDevice = "rxe0:2:3".parse().unwrap();
        assert_eq!((d.name.as_str(), d.port, d.gid_index), ("rxe0", 2, Some(3)));
        assert_eq!(d.to_string().parse::<IbDevice>().unwrap(), d);
        for bad in ["", ":1", "mlx5_0:0", "mlx5_0:x", "mlx5_0:1:300", "a/b", "mlx5_0:1:2:3"] {
            assert!(bad.parse::<IbDevice>().is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn fabric_round_trip() {
        let f: IbFabric = "mlx5_1:1:0@127.0.0.1:7100".parse().unwrap();
        assert_eq!(f.device.name, "mlx5_1");
        assert_eq!(f.host, "127.0.0.1:7100".parse().unwrap());
        assert_eq!(f.to_string().parse::<IbFabric>().unwrap(), f);
        assert!("mlx5_0".parse::<IbFabric>().is_err(), "the host part is required");
        assert!("@127.0.0.1:1".parse::<IbFabric>().is_err(), "the device is required");
    }
}
