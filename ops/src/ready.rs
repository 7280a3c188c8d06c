//! Process readiness: the flags a daemon's tasks set and `/readyz` reports.
//!
//! Each part a daemon needs before it can do its job (a server that serves, a registration,
//! an election) owns one [`ReadyFlag`] and sets it; [`ReadyFlags`] names what each flag
//! means while it is down, so `/readyz` tells an operator (through `kubectl describe`) which
//! part is missing rather than only that one is. "Ready" here is the process's readiness
//! probe; the health of GPUs is another matter (see ARCHITECTURE.md, Glossary).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// One shared on/off flag. Clones share the flag, so the task that sets it and the
/// [`ReadyFlags`] that reads it hold the same one.
#[derive(Clone, Debug, Default)]
pub struct ReadyFlag(Arc<AtomicBool>);

impl ReadyFlag {
    /// A flag that is down.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Raises (`true`) or lowers (`false`) the flag.
    pub fn set(&self, up: bool) {
        self.0.store(up, Ordering::Release);
    }

    /// Whether the flag is up.
    #[must_use]
    fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Wraps a flag that a task already shares as an `AtomicBool` (e.g. a server's "serving").
impl From<Arc<AtomicBool>> for ReadyFlag {
    fn from(flag: Arc<AtomicBool>) -> Self {
        Self(flag)
    }
}

/// A flag the process needs up to be ready, and what `/readyz` says while it is down.
#[derive(Clone, Debug)]
struct Required {
    flag: ReadyFlag,
    missing: &'static str,
}

/// A flag that does not decide readiness but says which role a ready process has.
#[derive(Clone, Debug)]
struct Role {
    flag: ReadyFlag,
    up: &'static str,
    down: &'static str,
}

/// What a process reports on `/readyz`: ready when every required [`ReadyFlag`] is up.
/// Clones share the flags.
#[derive(Clone, Debug, Default)]
pub struct ReadyFlags {
    required: Vec<Required>,
    role: Option<Role>,
}

impl ReadyFlags {
    /// No flags: ready at once (add flags with [`ReadyFlags::require`]).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Requires `flag` to be up; while it is down, `/readyz` names `missing`. Missing parts
    /// are named in the order they were required.
    #[must_use]
    pub fn require(mut self, flag: &ReadyFlag, missing: &'static str) -> Self {
        self.required.push(Required {
            flag: flag.clone(),
            missing,
        });
        self
    }

    /// A ready process reports `ok: <up>` while `flag` is up and `ok: <down>` while it is
    /// down (e.g. leader or standby), instead of `ok`.
    #[must_use]
    pub fn with_role(mut self, flag: &ReadyFlag, up: &'static str, down: &'static str) -> Self {
        self.role = Some(Role {
            flag: flag.clone(),
            up,
            down,
        });
        self
    }

    /// Whether every required flag is up.
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.required.iter().all(|r| r.flag.is_set())
    }

    /// The `/readyz` answer: `Ok(status)` when ready (`ok`, or `ok: <role>`), `Err` naming
    /// every missing part, joined with `; `, when not.
    ///
    /// # Errors
    /// A required flag is down; the message says which parts are missing.
    pub fn readiness(&self) -> Result<String, String> {
        let missing: Vec<&str> = self
            .required
            .iter()
            .filter(|r| !r.flag.is_set())
            .map(|r| r.missing)
            .collect();
        if !missing.is_empty() {
            return Err(missing.join("; "));
        }
        Ok(match &self.role {
            None => "ok".to_owned(),
            Some(role) if role.flag.is_set() => format!("ok: {}", role.up),
            Some(role) => format!("ok: {}", role.down),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_missing_part_is_named_in_order_until_all_are_up() {
        let (serving, registered) = (ReadyFlag::new(), ReadyFlag::new());
        let flags = ReadyFlags::new()
            .require(&serving, "not serving")
            .require(&registered, "not registered");
        assert_eq!(
            flags.readiness(),
            Err("not serving; not registered".to_owned())
        );
        serving.set(true);
        assert_eq!(flags.readiness(), Err("not registered".to_owned()));
        assert!(!flags.is_ready());
        registered.set(true);
        assert_eq!(flags.readiness(), Ok("ok".to_owned()));
        assert!(flags.clone().is_ready());
        serving.set(false);
        assert!(!flags.is_ready());
    }

    #[test]
    fn the_role_is_reported_only_when_ready() {
        let (started, leader) = (ReadyFlag::new(), ReadyFlag::new());
        let flags = ReadyFlags::new()
            .require(&started, "not started")
            .with_role(&leader, "leader", "standby");
        leader.set(true);
        assert_eq!(flags.readiness(), Err("not started".to_owned()));
        started.set(true);
        assert_eq!(flags.readiness(), Ok("ok: leader".to_owned()));
        leader.set(false);
        assert_eq!(flags.readiness(), Ok("ok: standby".to_owned()));
    }

    #[test]
    fn a_shared_atomic_is_the_same_flag() {
        let serving = Arc::new(AtomicBool::new(false));
        let flag = ReadyFlag::from(Arc::clone(&serving));
        serving.store(true, Ordering::Release);
        assert!(flag.is_set());
        assert!(ReadyFlags::new().is_ready());
    }
}
