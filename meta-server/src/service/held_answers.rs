//! A test hook, read from the environment at start: with
//! `CITRONFS_TEST_HOLD_ANSWERS=KIND[,KIND...]:DIR`, requests of those kinds
//! ([`MetaKind`] names, such as `Unlink`) are applied and made durable as
//! always, and then, while a file `DIR/hold` exists, never answered: the
//! thread writes `DIR/KIND` and waits until the process ends. A test kills the meta-server then, with a change
//! applied and its answer on its way, as a crash can. Unset, it costs one
//! branch per request.

use std::path::PathBuf;

use citronfs_core::rpc_counts::MetaKind;

const VARIABLE: &str = "CITRONFS_TEST_HOLD_ANSWERS";

#[derive(Debug, Default)]
pub(super) struct HeldAnswers {
    kinds: Vec<MetaKind>,
    marks: PathBuf,
}

impl HeldAnswers {
    pub fn from_env() -> Self {
        let Ok(value) = std::env::var(VARIABLE) else { return Self::default() };
        let Some((kinds, marks)) = value.split_once(':') else {
            log::error!("{VARIABLE}={value}: expected KIND[,KIND...]:DIR; ignored");
            return Self::default();
        };
        let kinds: Vec<MetaKind> = MetaKind::ALL
            .iter()
            .copied()
            .filter(|k| kinds.split(',').any(|name| name == format!("{k:?}")))
            .collect();
        log::warn!("{VARIABLE}: the answers to {kinds:?} are held forever (a test hook)");
        Self { kinds, marks: marks.into() }
    }

    /// Never returns if answers of `kind` are held.
    pub fn hold(&self, kind: MetaKind) {
        if self.kinds.is_empty() || !self.kinds.contains(&kind) || !self.marks.join("hold").exists() {
            return;
        }
        if let Err(e) = std::fs::write(self.marks.join(format!("{kind:?}")), b"") {
            log::error!("{VARIABLE}: cannot mark the held {kind:?}: {e}");
        }
        loop {
            std::thread::park();
        }
    }
}
