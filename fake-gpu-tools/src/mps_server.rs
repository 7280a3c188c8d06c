//! The fake control daemon's commands and the MPS limits they keep, as NVIDIA's MPS
//! documentation describes them ("Appendix: Tools and Interface Reference", the control
//! daemon's commands of the Legacy MPS v2 interface, and "Appendix: Environment Variables"):
//!
//! - `set_default_active_thread_percentage <percentage>` /
//!   `get_default_active_thread_percentage`: the active thread percentage a new MPS server
//!   takes; 100 until set. A server already spawned keeps the one it took ("only affects the
//!   next server"); `quit` loses it (the state lives as long as the daemon).
//! - `set_active_thread_percentage <PID> <percentage>` / `get_active_thread_percentage <PID>`:
//!   the running server's; clients created afterwards see it, existing clients do not.
//! - `set_default_device_pinned_mem_limit <dev> <value>` /
//!   `get_default_device_pinned_mem_limit <dev>`: the default pinned device memory limit of
//!   each client, per device (an index or a UUID; kerf names its daemon's one GPU `0`);
//!   `<value>` is an integer followed by `G` or `M` (`10G`, `4096M`). No limit until set.
//!   Only the next server takes it.
//! - `set_device_pinned_mem_limit <PID> <dev> <value>` / `get_device_pinned_mem_limit <PID>
//!   <dev>`: the running server's, for clients created afterwards.
//! - `get_server_list`: the PIDs of the servers, one a line; `start_server -uid <UID>` starts
//!   the server if there is none, `shutdown_server <PID> [-f]` ends it (the next client gets a
//!   new one, with the defaults of that moment).
//!
//! The daemon starts a server (one per Linux user; the fake has one user, so at most one
//! server) when the first client connects, and that server takes the daemon's defaults at that
//! moment. The fake has no server process: a server is a PID and its limits. Its PID is
//! [`PID_MAX_LIMIT`] × n + the daemon's PID, for the daemon's n-th server (n cycling through
//! 1..=511): above any PID Linux can hand out, so no test can mistake it for (or signal) a real
//! process, distinct between the daemons running at once, and still a positive `pid_t`.
//!
//! Replies (what the control client prints): nothing for a successful `set_*`, `start_server`
//! and `shutdown_server`; a percentage with one decimal (`100.0`, as the real one prints); a
//! pinned limit as MiB with `M` (`10240M`), nothing when the device has none; the server list,
//! nothing without a server. Errors are one line (the real daemon prints an error message
//! there, whose words the fake does not copy): `Invalid command` (unknown, or a wrong number of
//! arguments), `Invalid value` (a percentage outside (0, 100], a memory value that is not a
//! positive integer with `G` or `M`, a device that is neither an index nor a `GPU-`/`MIG-` UUID)
//! and `Invalid PID` (no server has it).
//!
//! [`CLIENT_CONNECT`] is the fake's own line, sent by the fake CUDA client
//! ([`crate::cuda_client`]) where real CUDA talks to the daemon and server in its own protocol:
//! it starts the server if there is none and answers the limits of a client created now, as
//! JSON ([`ServerLimits`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The fake CUDA client's line: "a client connects; which server, with which limits?".
pub(crate) const CLIENT_CONNECT: &str = "kerf_fake_client_connect";

/// The reply to an unknown command or one with the wrong number of arguments.
pub(crate) const INVALID_COMMAND: &str = "Invalid command";
/// The reply to a percentage, memory value or device that cannot be one.
pub(crate) const INVALID_VALUE: &str = "Invalid value";
/// The reply to a PID that names no server of this daemon.
pub(crate) const INVALID_PID: &str = "Invalid PID";

/// Linux's `PID_MAX_LIMIT` on 64-bit (2^22): the highest `pid_max` can be set to, so every real
/// PID is below it.
const PID_MAX_LIMIT: u32 = 4_194_304;
/// How many server PIDs a daemon hands out before it reuses them: the most that keep
/// `PID_MAX_LIMIT` × n + a PID below `i32::MAX` (`pid_t` is signed).
const SERVER_PID_CYCLE: u32 = 511;
/// The active thread percentage until one is set (NVIDIA: "default 100").
const DEFAULT_THREAD_PERCENTAGE: f64 = 100.0;

/// What a server (or the daemon's defaults for the next server) limits its clients to.
#[derive(Debug, Clone, PartialEq)]
struct Limits {
    thread_percentage: f64,
    /// Pinned device memory limits in MiB, by the device name they were set for.
    pinned_mib: BTreeMap<String, u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            thread_percentage: DEFAULT_THREAD_PERCENTAGE,
            pinned_mib: BTreeMap::new(),
        }
    }
}

/// The reply to [`CLIENT_CONNECT`]: the server the client was attached to and the limits it
/// gives a client created now (before the client's own environment constrains them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ServerLimits {
    pub(crate) server_pid: u32,
    pub(crate) thread_percentage: f64,
    /// By device name as set: `0`, another index, or a UUID.
    pub(crate) pinned_mem_limits_mib: BTreeMap<String, u64>,
}

#[derive(Debug)]
struct Server {
    pid: u32,
    limits: Limits,
}

/// A control daemon's state: its defaults and its server, for as long as it runs.
#[derive(Debug)]
pub(crate) struct ControlState {
    daemon_pid: u32,
    servers_started: u32,
    defaults: Limits,
    server: Option<Server>,
}

impl ControlState {
    /// The state of a daemon that just started, with process ID `daemon_pid`.
    pub(crate) fn new(daemon_pid: u32) -> Self {
        Self {
            daemon_pid,
            servers_started: 0,
            defaults: Limits::default(),
            server: None,
        }
    }

    /// The PID of the running server, if any.
    pub(crate) fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().map(|s| s.pid)
    }

    /// Runs `command` (one line, without `quit`, which the daemon's loop handles) and returns
    /// the reply to print, without a trailing newline; empty for none.
    pub(crate) fn answer(&mut self, command: &str) -> String {
        let words: Vec<&str> = command.split_whitespace().collect();
        self.run(&words).unwrap_or_else(str::to_owned)
    }

    fn run(&mut self, words: &[&str]) -> Result<String, &'static str> {
        let none = String::new;
        match *words {
            ["get_server_list"] => Ok(self.server_pid().map(|p| p.to_string()).unwrap_or_default()),
            ["start_server", "-uid", uid] => {
                uid.parse::<u32>().map_err(|_| INVALID_VALUE)?;
                self.server_or_start();
                Ok(none())
            }
            ["shutdown_server", pid] | ["shutdown_server", pid, "-f"] => {
                self.server_limits(pid)?;
                self.server = None;
                Ok(none())
            }
            ["get_default_active_thread_percentage"] => {
                Ok(format_percentage(self.defaults.thread_percentage))
            }
            ["set_default_active_thread_percentage", value] => {
                self.defaults.thread_percentage = parse_percentage(value).ok_or(INVALID_VALUE)?;
                Ok(none())
            }
            ["get_active_thread_percentage", pid] => Ok(format_percentage(
                self.server_limits(pid)?.thread_percentage,
            )),
            ["set_active_thread_percentage", pid, value] => {
                let limits = self.server_limits(pid)?;
                limits.thread_percentage = parse_percentage(value).ok_or(INVALID_VALUE)?;
                Ok(none())
            }
            ["get_default_device_pinned_mem_limit", dev] => get_pinned(&self.defaults, dev),
            ["set_default_device_pinned_mem_limit", dev, value] => {
                set_pinned(&mut self.defaults, dev, value).map(|()| none())
            }
            ["get_device_pinned_mem_limit", pid, dev] => get_pinned(self.server_limits(pid)?, dev),
            ["set_device_pinned_mem_limit", pid, dev, value] => {
                set_pinned(self.server_limits(pid)?, dev, value).map(|()| none())
            }
            [CLIENT_CONNECT] => {
                let server = self.server_or_start();
                let limits = ServerLimits {
                    server_pid: server.pid,
                    thread_percentage: server.limits.thread_percentage,
                    pinned_mem_limits_mib: server.limits.pinned_mib.clone(),
                };
                // Cannot fail (no map with non-string keys), but no panic on a reply either.
                serde_json::to_string(&limits).map_err(|_| INVALID_COMMAND)
            }
            _ => Err(INVALID_COMMAND),
        }
    }

    /// The running server, or a new one that takes the defaults of this moment.
    fn server_or_start(&mut self) -> &mut Server {
        self.server.get_or_insert_with(|| {
            self.servers_started += 1;
            Server {
                pid: fake_server_pid(self.daemon_pid, self.servers_started),
                limits: self.defaults.clone(),
            }
        })
    }

    /// The limits of the running server whose PID is `pid`.
    fn server_limits(&mut self, pid: &str) -> Result<&mut Limits, &'static str> {
        let pid: u32 = pid.parse().map_err(|_| INVALID_PID)?;
        match &mut self.server {
            Some(server) if server.pid == pid => Ok(&mut server.limits),
            _ => Err(INVALID_PID),
        }
    }
}

/// The PID of a daemon's `n`-th server (from 1); see the module documentation.
fn fake_server_pid(daemon_pid: u32, n: u32) -> u32 {
    let cycle = (n.max(1) - 1) % SERVER_PID_CYCLE + 1;
    // A real PID is below PID_MAX_LIMIT, so this is at most i32::MAX.
    PID_MAX_LIMIT * cycle + daemon_pid.min(PID_MAX_LIMIT - 1)
}

fn get_pinned(limits: &Limits, dev: &str) -> Result<String, &'static str> {
    if !is_device(dev) {
        return Err(INVALID_VALUE);
    }
    Ok(limits
        .pinned_mib
        .get(dev)
        .map(|mib| format!("{mib}M"))
        .unwrap_or_default())
}

fn set_pinned(limits: &mut Limits, dev: &str, value: &str) -> Result<(), &'static str> {
    let mib = parse_mem_mib(value).ok_or(INVALID_VALUE)?;
    if !is_device(dev) {
        return Err(INVALID_VALUE);
    }
    limits.pinned_mib.insert(dev.to_owned(), mib);
    Ok(())
}

/// A percentage as the real daemon prints it: one decimal.
fn format_percentage(value: f64) -> String {
    format!("{value:.1}")
}

/// An active thread percentage: a number in (0, 100] (`25`, `12.5`).
pub(crate) fn parse_percentage(text: &str) -> Option<f64> {
    let value: f64 = text.parse().ok()?;
    (value.is_finite() && value > 0.0 && value <= 100.0).then_some(value)
}

/// A pinned memory value in MiB: a positive integer followed by `G` or `M` (`10G` is 10240).
/// Zero is refused: a limit that leaves no memory is a mistake the fake should not hide.
pub(crate) fn parse_mem_mib(text: &str) -> Option<u64> {
    let (digits, per_unit) = if let Some(digits) = text.strip_suffix('G') {
        (digits, 1024)
    } else {
        (text.strip_suffix('M')?, 1)
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mib = digits.parse::<u64>().ok()?.checked_mul(per_unit)?;
    (mib > 0).then_some(mib)
}

/// A device index (`0`).
pub(crate) fn is_index(dev: &str) -> bool {
    !dev.is_empty() && dev.bytes().all(|b| b.is_ascii_digit())
}

/// A device name: an index or a GPU or MIG UUID (`GPU-…`, `MIG-…`).
pub(crate) fn is_device(dev: &str) -> bool {
    is_index(dev)
        || ["GPU-", "MIG-"].iter().any(|prefix| {
            dev.strip_prefix(prefix)
                .is_some_and(|rest| !rest.is_empty())
        })
}

/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`: `<dev>=<value>[,<dev>=<value>...]` in MiB by device.
pub(crate) fn parse_pinned_list(text: &str) -> Option<BTreeMap<String, u64>> {
    text.split(',')
        .map(|entry| {
            let (dev, value) = entry.trim().split_once('=')?;
            if !is_device(dev) {
                return None;
            }
            Some((dev.to_owned(), parse_mem_mib(value)?))
        })
        .collect()
}

#[cfg(test)]
#[allow(
    clippy::float_cmp,
    reason = "percentages parsed from short decimals compare exactly; a tolerance would hide a change"
)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-2f4e0e00-e140-bcbd-d4fd-278c95116d02";

    #[test]
    fn percentages_are_numbers_above_0_up_to_100() {
        assert_eq!(parse_percentage("25"), Some(25.0));
        assert_eq!(parse_percentage("12.5"), Some(12.5));
        assert_eq!(parse_percentage("100"), Some(100.0));
        for bad in ["0", "101", "-5", "abc", "", "NaN", "inf", "100.01"] {
            assert_eq!(parse_percentage(bad), None, "{bad}");
        }
        assert_eq!(format_percentage(100.0), "100.0");
        assert_eq!(format_percentage(12.5), "12.5");
    }

    #[test]
    fn memory_values_are_integers_with_g_or_m() {
        assert_eq!(parse_mem_mib("10G"), Some(10_240));
        assert_eq!(parse_mem_mib("4096M"), Some(4096));
        for bad in [
            "10Q",
            "10",
            "G",
            "M",
            "0G",
            "0M",
            "-1G",
            "+1G",
            "1.5G",
            "10g",
            "10GB",
            "10 G",
            "",
            "é",
            "99999999999999999999G",
        ] {
            assert_eq!(parse_mem_mib(bad), None, "{bad}");
        }
        assert_eq!(parse_mem_mib(&format!("{}G", u64::MAX / 1024 + 1)), None);
    }

    #[test]
    fn devices_are_indices_or_uuids() {
        assert!(is_device("0") && is_device("12") && is_device(UUID) && is_device("MIG-x"));
        for bad in ["x", "", "GPU-", "-1", "gpu-1"] {
            assert!(!is_device(bad), "{bad}");
        }
    }

    #[test]
    fn the_client_env_list_names_devices_and_values() {
        let list = parse_pinned_list(&format!("0=4096M, {UUID}=2G")).unwrap();
        assert_eq!(
            list,
            BTreeMap::from([("0".to_owned(), 4096), (UUID.to_owned(), 2048)])
        );
        for bad in ["0", "0=", "=1G", "0=1G,", "x=1G", "0=1G,1=5Q", ""] {
            assert_eq!(parse_pinned_list(bad), None, "{bad}");
        }
    }

    fn connect(state: &mut ControlState) -> ServerLimits {
        serde_json::from_str(&state.answer(CLIENT_CONNECT)).unwrap()
    }

    #[test]
    fn a_server_takes_the_defaults_of_its_start_and_later_defaults_reach_only_the_next() {
        let mut state = ControlState::new(321);
        assert_eq!(state.answer("get_server_list"), "");
        assert_eq!(
            state.answer("get_default_active_thread_percentage"),
            "100.0"
        );
        assert_eq!(
            state.answer(&format!("get_default_device_pinned_mem_limit {UUID}")),
            ""
        );
        assert_eq!(state.answer("set_default_active_thread_percentage 25"), "");
        assert_eq!(
            state.answer(&format!("set_default_device_pinned_mem_limit {UUID} 10G")),
            ""
        );
        let first = connect(&mut state);
        assert_eq!(first.server_pid, PID_MAX_LIMIT + 321);
        assert_eq!(first.thread_percentage, 25.0);
        assert_eq!(first.pinned_mem_limits_mib[UUID], 10_240);
        assert_eq!(
            state.answer("get_server_list"),
            first.server_pid.to_string()
        );

        assert_eq!(state.answer("set_default_active_thread_percentage 10"), "");
        assert_eq!(
            state.answer(&format!("set_default_device_pinned_mem_limit {UUID} 2G")),
            ""
        );
        assert_eq!(
            connect(&mut state),
            first,
            "the running server keeps its limits"
        );
        assert_eq!(
            state.answer(&format!("get_default_device_pinned_mem_limit {UUID}")),
            "2048M"
        );

        let pid = first.server_pid;
        assert_eq!(
            state.answer(&format!("set_active_thread_percentage {pid} 50")),
            ""
        );
        assert_eq!(
            state.answer(&format!("set_device_pinned_mem_limit {pid} 0 4G")),
            ""
        );
        assert_eq!(
            state.answer(&format!("get_active_thread_percentage {pid}")),
            "50.0"
        );
        assert_eq!(
            state.answer(&format!("get_device_pinned_mem_limit {pid} 0")),
            "4096M"
        );
        let changed = connect(&mut state);
        assert_eq!(changed.thread_percentage, 50.0);
        assert_eq!(changed.pinned_mem_limits_mib["0"], 4096);

        assert_eq!(state.answer(&format!("shutdown_server {pid} -f")), "");
        assert_eq!(state.answer("get_server_list"), "");
        let next = connect(&mut state);
        assert_eq!(next.server_pid, 2 * PID_MAX_LIMIT + 321, "a new PID");
        assert_eq!(next.thread_percentage, 10.0, "the defaults of its start");
        assert_eq!(next.pinned_mem_limits_mib[UUID], 2048);
    }

    #[test]
    fn bad_commands_values_and_pids_get_an_error_and_change_nothing() {
        let mut state = ControlState::new(7);
        for (command, reply) in [
            ("set_default_device_pinned_mem_limit x 10G", INVALID_VALUE),
            ("set_default_device_pinned_mem_limit 0 10Q", INVALID_VALUE),
            ("set_default_active_thread_percentage 0", INVALID_VALUE),
            ("set_default_active_thread_percentage 101", INVALID_VALUE),
            ("set_default_active_thread_percentage abc", INVALID_VALUE),
            ("set_default_active_thread_percentage", INVALID_COMMAND),
            ("set_active_thread_percentage 4194311 50", INVALID_PID),
            ("get_device_pinned_mem_limit abc 0", INVALID_PID),
            ("shutdown_server 7", INVALID_PID),
            ("start_server -uid root", INVALID_VALUE),
            ("frobnicate", INVALID_COMMAND),
            ("", INVALID_COMMAND),
        ] {
            assert_eq!(state.answer(command), reply, "{command}");
        }
        assert_eq!(
            state.answer("get_default_active_thread_percentage"),
            "100.0"
        );
        assert_eq!(state.answer("get_default_device_pinned_mem_limit 0"), "");
        assert_eq!(state.server_pid(), None);
        assert_eq!(state.answer("start_server -uid 1000"), "");
        let pid = PID_MAX_LIMIT + 7;
        assert_eq!(state.server_pid(), Some(pid));
        assert_eq!(
            state.answer(&format!("set_active_thread_percentage {pid} 0")),
            INVALID_VALUE
        );
        assert_eq!(
            state.answer(&format!("get_active_thread_percentage {pid}")),
            "100.0"
        );
    }

    #[test]
    fn server_pids_are_above_every_real_pid_and_stay_positive_pid_ts() {
        let highest = fake_server_pid(PID_MAX_LIMIT - 1, SERVER_PID_CYCLE);
        assert!(i32::try_from(highest).is_ok(), "{highest}");
        assert_eq!(fake_server_pid(1, SERVER_PID_CYCLE + 1), PID_MAX_LIMIT + 1);
        assert!(fake_server_pid(1, 1) > PID_MAX_LIMIT);
    }
}
