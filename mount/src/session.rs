//! Mounting: the FUSE session every citronfs mount is made with (mount
//! options, workers with cloned `/dev/fuse` descriptors) and the threads
//! it hands the file system (the coherence notifier, the invalidation
//! thread).

use std::path::Path;
use std::sync::Arc;

use crate::CitronFuse;

/// A mounted session; unmounts when dropped.
pub use fuser::BackgroundSession;

/// Mounts `fs` at `mountpoint` and serves it on `MountOptions::threads`
/// workers until it is unmounted; returns the background session.
pub fn spawn_mount(fs: CitronFuse, mountpoint: &Path) -> std::io::Result<fuser::BackgroundSession> {
    spawn_mount_with(fs, mountpoint, "citronfs", &[])
}

/// As [`spawn_mount`], with `source` as the mount's source (what
/// `/proc/mounts` and `findmnt` show; mount(8) matches fstab lines by it)
/// and `extra` mount options (`ro`, `nosuid`, `nodev`, ...) that replace
/// the defaults they contradict.
pub fn spawn_mount_with(
    fs: CitronFuse,
    mountpoint: &Path,
    source: &str,
    extra: &[fuser::MountOption],
) -> std::io::Result<fuser::BackgroundSession> {
    use fuser::MountOption as O;
    let mut config = session_config("citronfs", fs.options.threads);
    let contradicted = |o: &O| match o {
        O::FSName(_) => true,
        O::Dev => extra.contains(&O::NoDev),
        O::Suid => extra.contains(&O::NoSuid),
        _ => false,
    };
    config.mount_options.retain(|o| !contradicted(o));
    config.mount_options.push(O::FSName(source.into()));
    config.mount_options.extend(extra.iter().cloned());
    new_session(fs, mountpoint, &config)?.spawn()
}

/// Mounts `fs` at `mountpoint` as a session not yet served (`run` or
/// `spawn` it), with the file system given the session's notifier: the
/// coherence of shared mappings across mounts invalidates the kernel's
/// pages through it (see [`coherence`](crate::coherence)). Every citronfs session is made
/// here.
pub fn new_session(
    fs: CitronFuse,
    mountpoint: &Path,
    config: &fuser::Config,
) -> std::io::Result<fuser::Session<CitronFuse>> {
    let invalidator = fs.coherence.invalidator().clone();
    let moved_dirs = fs.moved_dirs.clone();
    let caching = (!fs.options.cache_ttl.is_zero()).then(|| (fs.invalidations(), Arc::downgrade(&fs.client)));
    let session = fuser::Session::new(fs, mountpoint, config)?;
    invalidator.set_notifier(session.notifier());
    use std::os::fd::AsFd;
    moved_dirs.set_device(session.as_fd().try_clone_to_owned()?);
    if let Some((control, client)) = caching {
        // Ends with the file system (its drop stops it) or the client.
        let device = session.as_fd().try_clone_to_owned()?;
        control.spawn(client, session.notifier(), device)?;
    }
    Ok(session)
}

/// How every citronfs session is mounted and served (mount options, access,
/// `threads` workers each with its own cloned `/dev/fuse` descriptor), for
/// another FUSE file system that must be mounted the same way (the lock
/// benchmark's FUSE ceiling).
pub fn session_config(fsname: &str, threads: usize) -> fuser::Config {
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName(fsname.into()),
        fuser::MountOption::Subtype(fsname.into()),
        // fuser gives the subtype only to fusermount; mounted directly (as
        // root) the kernel needs it as an option, or the type is plain
        // "fuse" and mount(8), findmnt and fstab lines cannot tell us apart.
        fuser::MountOption::CUSTOM(format!("subtype={fsname}")),
        fuser::MountOption::DefaultPermissions,
        fuser::MountOption::Dev,
        fuser::MountOption::Suid,
    ];
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(threads.max(1));
    config.clone_fd = true;
    config
}
