//! `kerf-fake-cuda-client`: a fake CUDA program under MPS, so that a test can see which limits
//! a workload would run with, and that an allocation above its memory limit fails.
//!
//! What it imitates (NVIDIA's MPS documentation, "Appendix: Environment Variables" and the
//! control daemon's description): a CUDA program connects to the control daemon of
//! `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`), which starts the MPS server if there
//! is none, and becomes a client of that server with the server's limits at that moment.
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` "will only further constrain the limit set by the
//! control daemon", and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`<dev>=<value>[,…]`, value an
//! integer with `G` or `M`) likewise only lowers the server's pinned memory limit: the client's
//! limit is the smaller of the two, and a client without a server-side limit has only its own.
//!
//! kerf's workloads see their GPU as device 0, so the limits that apply are those named `0`
//! and those named by the GPU's UUID: `--device <UUID>` says which UUID device 0 is (default:
//! the first UUID the server has a limit for); where both are set, the smaller holds. Limits
//! for other indices name devices the client does not have.
//!
//! Arguments: `--alloc <value>` (`12G`, `10240M`) an allocation to try; `--device <UUID>`.
//! It asks the daemon with [`CLIENT_CONNECT`] and prints one JSON line ([`Outcome`]). Exit
//! codes: 0 (the allocation fits, or none was asked), 2 (it exceeds the pinned memory limit:
//! CUDA's `out of memory` on stderr), 1 (no daemon, a bad argument or environment variable).
//! Without a daemon a real CUDA program runs without MPS, unconstrained by its limits; the
//! fake fails instead, so that a test sees that its workload would not have been limited.

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::mps_server::{
    CLIENT_CONNECT, ServerLimits, is_index, parse_mem_mib, parse_percentage, parse_pinned_list,
};

/// The name the fake CUDA client runs as.
pub(crate) const NAME: &str = "kerf-fake-cuda-client";
/// How long it waits for the daemon's reply: a hang guard for tests, not a real timeout.
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// The exit code of an allocation that does not fit.
const OUT_OF_MEMORY: i32 = 2;

/// What the client ran with, printed as its one line of JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
struct Outcome {
    server_pid: u32,
    /// The effective active thread percentage.
    thread_percentage: f64,
    /// The effective pinned memory limit of device 0 in MiB; `None` without one.
    pinned_mem_limit_mib: Option<u64>,
    /// The allocation it tried, in MiB.
    alloc_mib: Option<u64>,
    allocated: bool,
}

/// The command line of the client.
#[derive(Debug, Default, PartialEq)]
struct Args {
    alloc_mib: Option<u64>,
    device: Option<String>,
}

/// The client's own limits from its environment.
#[derive(Debug, Default, PartialEq)]
struct ClientEnv {
    thread_percentage: Option<f64>,
    pinned_mib: BTreeMap<String, u64>,
}

/// Runs the fake CUDA client with `args` (after the program name) and returns its exit code.
pub(crate) fn run(root: &Path, args: &[String]) -> i32 {
    crate::record(root, NAME, args, "");
    match attempt(args) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("{NAME}: {message}");
            1
        }
    }
}

fn attempt(args: &[String]) -> Result<i32, String> {
    let args = parse_args(args)?;
    let env = parse_env(
        std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            .ok()
            .as_deref(),
        std::env::var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .ok()
            .as_deref(),
    )?;
    let server = connect(&crate::pipe_dir().join("control"))?;
    let outcome = effective(&server, args.device.as_deref(), &env, args.alloc_mib);
    let line = serde_json::to_string(&outcome).map_err(|e| e.to_string())?;
    // Not `println!`: a closed stdout must not make it panic.
    let _ = writeln!(std::io::stdout(), "{line}");
    match (
        outcome.allocated,
        outcome.alloc_mib,
        outcome.pinned_mem_limit_mib,
    ) {
        (false, Some(asked), Some(limit)) => {
            eprintln!(
                "CUDA error: out of memory (an allocation of {asked} MiB exceeds the MPS \
                 client's pinned device memory limit of {limit} MiB on device 0)"
            );
            Ok(OUT_OF_MEMORY)
        }
        _ => Ok(0),
    }
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut parsed = Args::default();
    let mut words = args.iter();
    while let Some(word) = words.next() {
        let value = words.next().ok_or_else(|| usage(word))?;
        match word.as_str() {
            "--alloc" => {
                let mib = parse_mem_mib(value)
                    .ok_or_else(|| format!("--alloc {value:?}: not an integer with G or M"))?;
                parsed.alloc_mib = Some(mib);
            }
            "--device" => parsed.device = Some(value.clone()),
            _ => return Err(usage(word)),
        }
    }
    Ok(parsed)
}

fn usage(word: &str) -> String {
    format!("unexpected {word:?}; arguments: [--alloc <N>G|<N>M] [--device <GPU UUID>]")
}

/// The client's environment variables (unset or empty: no limit of its own).
fn parse_env(thread: Option<&str>, pinned: Option<&str>) -> Result<ClientEnv, String> {
    let thread_percentage = match thread.filter(|t| !t.is_empty()) {
        None => None,
        Some(text) => Some(parse_percentage(text).ok_or_else(|| {
            format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={text:?} is not a percentage in (0, 100]")
        })?),
    };
    let pinned_mib = match pinned.filter(|p| !p.is_empty()) {
        None => BTreeMap::new(),
        Some(text) => parse_pinned_list(text).ok_or_else(|| {
            format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={text:?} is not <dev>=<N>G|<N>M[,...]")
        })?,
    };
    Ok(ClientEnv {
        thread_percentage,
        pinned_mib,
    })
}

/// Asks the daemon behind `socket` for a server and its limits for a new client.
fn connect(socket: &Path) -> Result<ServerLimits, String> {
    let reply = UnixStream::connect(socket)
        .and_then(|mut stream| {
            stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
            stream.write_all(format!("{CLIENT_CONNECT}\n").as_bytes())?;
            stream.shutdown(std::net::Shutdown::Write)?;
            let mut reply = String::new();
            stream.read_to_string(&mut reply)?;
            Ok(reply)
        })
        .map_err(|error| {
            format!(
                "cannot reach the MPS control daemon at {} ({error}); a real CUDA program \
                 would run without MPS here, unconstrained by MPS limits",
                socket.display()
            )
        })?;
    serde_json::from_str(reply.trim())
        .map_err(|_| format!("the MPS control daemon answered {:?}", reply.trim()))
}

/// The client's limits: the server's, lowered (never raised) by the client's environment,
/// and whether an allocation of `alloc_mib` fits them.
fn effective(
    server: &ServerLimits,
    device: Option<&str>,
    env: &ClientEnv,
    alloc_mib: Option<u64>,
) -> Outcome {
    let device = device.or_else(|| {
        server
            .pinned_mem_limits_mib
            .keys()
            .map(String::as_str)
            .find(|dev| !is_index(dev))
    });
    let thread_percentage = env
        .thread_percentage
        .map_or(server.thread_percentage, |own| {
            own.min(server.thread_percentage)
        });
    let pinned_mem_limit_mib = [
        device_zero_limit(&server.pinned_mem_limits_mib, device),
        device_zero_limit(&env.pinned_mib, device),
    ]
    .into_iter()
    .flatten()
    .min();
    let allocated = match (alloc_mib, pinned_mem_limit_mib) {
        (Some(asked), Some(limit)) => asked <= limit,
        _ => true,
    };
    Outcome {
        server_pid: server.server_pid,
        thread_percentage,
        pinned_mem_limit_mib,
        alloc_mib,
        allocated,
    }
}

/// The smallest of `limits` that names device 0: as `0` or by its UUID `device`.
fn device_zero_limit(limits: &BTreeMap<String, u64>, device: Option<&str>) -> Option<u64> {
    limits
        .iter()
        .filter(|(dev, _)| dev.as_str() == "0" || Some(dev.as_str()) == device)
        .map(|(_, mib)| *mib)
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-2f4e0e00-e140-bcbd-d4fd-278c95116d02";

    fn server(thread_percentage: f64, pinned: &[(&str, u64)]) -> ServerLimits {
        ServerLimits {
            server_pid: 4_194_305,
            thread_percentage,
            pinned_mem_limits_mib: pinned.iter().map(|(d, m)| ((*d).to_owned(), *m)).collect(),
        }
    }

    fn env(thread: Option<&str>, pinned: Option<&str>) -> ClientEnv {
        parse_env(thread, pinned).unwrap()
    }

    #[test]
    fn arguments_are_an_allocation_and_a_device() {
        let args = |a: &[&str]| parse_args(&a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        assert_eq!(args(&[]), Ok(Args::default()));
        assert_eq!(
            args(&["--alloc", "12G", "--device", UUID]),
            Ok(Args {
                alloc_mib: Some(12_288),
                device: Some(UUID.to_owned())
            })
        );
        for bad in [
            &["--alloc"][..],
            &["--alloc", "12"],
            &["--size", "1G"],
            &["x"],
        ] {
            assert!(args(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_environment_is_read_strictly_and_empty_means_unset() {
        assert_eq!(env(Some(""), Some("")), ClientEnv::default());
        assert_eq!(env(Some("25"), None).thread_percentage, Some(25.0));
        assert_eq!(env(None, Some("0=20G")).pinned_mib["0"], 20_480);
        assert!(parse_env(Some("0"), None).is_err());
        assert!(parse_env(None, Some("0=20")).is_err());
    }

    #[test]
    fn the_environment_only_lowers_the_servers_limits() {
        let held = server(25.0, &[(UUID, 10_240)]);
        let asks_more = effective(&held, None, &env(Some("100"), Some("0=20G")), Some(12_288));
        assert_eq!(
            (
                asks_more.thread_percentage,
                asks_more.pinned_mem_limit_mib,
                asks_more.allocated
            ),
            (25.0, Some(10_240), false)
        );
        let asks_less = effective(&held, Some(UUID), &env(Some("10"), Some("0=4096M")), None);
        assert_eq!(
            (
                asks_less.thread_percentage,
                asks_less.pinned_mem_limit_mib,
                asks_less.allocated
            ),
            (10.0, Some(4096), true)
        );
        let by_uuid = effective(&held, None, &env(None, Some(&format!("{UUID}=2G"))), None);
        assert_eq!(by_uuid.pinned_mem_limit_mib, Some(2048));
        let unlimited = effective(
            &server(100.0, &[]),
            None,
            &ClientEnv::default(),
            Some(81_920),
        );
        assert_eq!(
            (
                unlimited.thread_percentage,
                unlimited.pinned_mem_limit_mib,
                unlimited.allocated
            ),
            (100.0, None, true)
        );
        let own_only = effective(&server(100.0, &[]), None, &env(None, Some("0=1G")), None);
        assert_eq!(own_only.pinned_mem_limit_mib, Some(1024));
    }

    #[test]
    fn limits_for_device_0_are_those_named_0_or_by_its_uuid() {
        let other = "GPU-00000000-0000-0000-0000-000000000001";
        let both = server(
            100.0,
            &[("0", 8192), (UUID, 4096), ("1", 1024), (other, 512)],
        );
        assert_eq!(
            effective(&both, Some(UUID), &ClientEnv::default(), None).pinned_mem_limit_mib,
            Some(4096),
            "the smaller of `0` and the UUID; index 1 and another GPU are not device 0"
        );
        assert_eq!(
            effective(
                &server(100.0, &[("1", 1024)]),
                None,
                &ClientEnv::default(),
                None
            )
            .pinned_mem_limit_mib,
            None
        );
        assert_eq!(
            effective(
                &server(100.0, &[(UUID, 4096)]),
                Some(other),
                &ClientEnv::default(),
                None
            )
            .pinned_mem_limit_mib,
            None,
            "a limit for another GPU does not hold this one"
        );
    }
}
