//! The kubelet plugin reaps the MPS control daemons it starts: the fake
//! `nvidia-cuda-mps-control -d` daemonizes with a double fork as the real one does, so each
//! daemon is re-parented to the plugin's init (`kerf_kubelet_plugin::reaper`), which must
//! reap it once it quits. The plugin runs as its own process (`kerf-test-plugin`) as in its
//! container: as PID 1 of a new PID namespace (`unshare --pid --fork`, root only), and with
//! `--init=always` where it is not PID 1. Each test drives 50 daemon starts and stops through
//! the DRA socket and then counts the zombies in the plugin's process tree.
//!
//! Under `CI=true`, a missing `unshare` (or the right to use it) fails the PID-namespace test
//! instead of skipping it.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::mps::MpsNode;
use crate::common::{DRIVER, GIB, NODE, uid};
use kerf_core::mps::PID_FILE;
use kerf_tests::api_server::ApiServer;
use kerf_tests::fake_api::Identity;
use kerf_tests::fake_kubelet::{FakeKubelet, Pod};

const CYCLES: u32 = 50;

/// One process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone)]
struct Process {
    parent: u32,
    /// Its PID in its own PID namespace (the last `NSpid` of its status), which is what a PID
    /// file written there holds.
    inner_pid: u32,
    state: char,
    name: String,
}

/// Every process of the machine (of this PID namespace's view), by PID.
fn processes() -> BTreeMap<u32, Process> {
    let mut all = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A process can end between the listing and the read.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let mut rest = stat[close + 1..].split_whitespace();
        let state = rest.next().and_then(|s| s.chars().next()).unwrap_or('?');
        let parent = rest.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        let name = stat[open + 1..close].to_owned();
        let inner_pid = std::fs::read_to_string(entry.path().join("status"))
            .ok()
            .and_then(|status| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("NSpid:"))
                    .and_then(|ids| ids.split_whitespace().last()?.parse().ok())
            })
            .unwrap_or(pid);
        all.insert(
            pid,
            Process {
                parent,
                inner_pid,
                state,
                name,
            },
        );
    }
    all
}

/// The processes below `root` (not `root` itself).
fn descendants(root: u32) -> BTreeMap<u32, Process> {
    let all = processes();
    let mut below = BTreeMap::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for (pid, process) in all.iter().filter(|(_, p)| p.parent == parent) {
            if below.insert(*pid, process.clone()).is_none() {
                frontier.push(*pid);
            }
        }
    }
    below
}

/// The zombies below `root`, waiting up to `settle` for the last one to be reaped: a daemon
/// that has just quit is a zombie until its adoptive parent collects it. Without a reaper
/// they stay, so the wait only decides how long a failing test takes.
fn zombies_after(root: u32, settle: Duration) -> Vec<(u32, Process)> {
    let started = Instant::now();
    loop {
        let zombies: Vec<(u32, Process)> = descendants(root)
            .into_iter()
            .filter(|(_, p)| p.state == 'Z')
            .collect();
        if zombies.is_empty() || started.elapsed() > settle {
            return zombies;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The plugin process: `launcher` (such as `unshare …`) then `kerf-test-plugin` with the
/// fake tools, `--init=<init>`.
fn spawn_plugin(sharing: &MpsNode, kubeconfig: &Path, launcher: &[&str], init: &str) -> Child {
    sharing
        .plugin_command(kubeconfig, init, launcher)
        .arg(format!("--init={init}"))
        .spawn()
        .unwrap()
}

/// A node with the fake tools, its API server, the plugin (started by `launcher`) and a
/// kubelet it registered with.
struct Running {
    sharing: MpsNode,
    _server: ApiServer,
    plugin: Child,
    kubelet: FakeKubelet,
    /// Whether the plugin runs in its own PID namespace, where its PID files name PIDs that
    /// mean other processes out here.
    namespaced: bool,
}

async fn start(launcher: &[&str], init: &str) -> Running {
    let sharing = MpsNode::new();
    let server = ApiServer::start(sharing.node.api.clone()).await.unwrap();
    let kubeconfig = sharing.node.root.join("kubeconfig");
    server
        .write_kubeconfig_for(&kubeconfig, Identity::kerf_kubelet_plugin(NODE))
        .unwrap();
    let plugin = spawn_plugin(&sharing, &kubeconfig, launcher, init);
    let kubelet = FakeKubelet::start(sharing.node.kubelet_config());
    let registered = kubelet
        .wait_for_registration(1, Duration::from_secs(20))
        .await;
    let log = std::fs::read_to_string(sharing.node.root.join(format!("plugin-{init}.log")));
    registered.unwrap_or_else(|e| panic!("{e}; plugin log:\n{}", log.unwrap_or_default()));
    Running {
        sharing,
        _server: server,
        plugin,
        kubelet,
        namespaced: !launcher.is_empty(),
    }
}

impl Running {
    /// `cycles` MPS slices of GPU 0 prepared and unprepared one after another: each starts a
    /// daemon and stops it. Returns the parent of each daemon while it ran.
    async fn cycle(&self, cycles: u32) -> Vec<u32> {
        let gpu = self.sharing.gpu_uuid(0);
        let mut parents = Vec::new();
        for n in 0..cycles {
            let claim = self.sharing.node.slice_claim(
                &format!("slice-{n}"),
                &uid(1000 + n),
                0,
                10 * GIB,
                25,
            );
            let pod = Pod::new(&format!("pod-{n}")).with_claim(DRIVER, claim);
            self.kubelet.prepare_pod(&pod).await.unwrap();
            // The PID file holds the daemon's PID in the plugin's namespace.
            let written: u32 = std::fs::read_to_string(self.sharing.pipe(&gpu).join(PID_FILE))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let daemon = descendants(self.pid())
                .into_values()
                .find(|p| p.inner_pid == written && p.state != 'Z')
                .unwrap_or_else(|| panic!("cycle {n}: no daemon {written} below the plugin"));
            parents.push(daemon.parent);
            self.kubelet.unprepare_pod(&pod).await.unwrap();
            assert!(
                !self.sharing.pipe(&gpu).join(PID_FILE).exists(),
                "cycle {n}: stopped"
            );
        }
        assert_eq!(self.sharing.starts(&gpu).len(), cycles as usize);
        parents
    }

    fn pid(&self) -> u32 {
        self.plugin.id()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.plugin.kill();
        let _ = self.plugin.wait();
        if self.namespaced {
            // `--kill-child` took the namespace and its daemons down with `unshare`; what
            // their PID files say would make MpsNode's clean-up kill unrelated processes.
            let _ = std::fs::remove_dir_all(self.sharing.mps_root());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_daemons_started_and_stopped_under_the_init_leave_no_zombie() {
    let running = start(&[], "always").await;
    let init = running.pid();
    let parents = running.cycle(CYCLES).await;
    assert!(
        parents.iter().all(|p| *p == init),
        "every daemon is an orphan adopted by the init (pid {init}), not the plugin's child: {parents:?}"
    );
    let zombies = zombies_after(init, Duration::from_secs(5));
    assert!(
        zombies.is_empty(),
        "{} zombies under the plugin, the first: {:?}",
        zombies.len(),
        zombies.first()
    );

    // SIGTERM reaches the plugin through the init, which exits with the plugin's status.
    let mut running = running;
    let status = Command::new("kill")
        .args(["-TERM", &init.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let started = Instant::now();
    let exit = loop {
        if let Some(exit) = running.plugin.try_wait().unwrap() {
            break exit;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the plugin did not stop on SIGTERM to its init"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit}");
}

/// `unshare --pid --fork` works here (root, or a kernel that lets this user do it).
fn pid_namespaces_available() -> bool {
    let works = Command::new("unshare")
        .args(&UNSHARE[1..])
        .arg("true")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !works {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true: `unshare --pid --fork` must work for the PID 1 reaping test"
        );
        eprintln!("skipped: `unshare --pid --fork` does not work here (not root?)");
    }
    works
}

/// A PID namespace with its own `/proc`, as a container has: the plugin reads its daemons'
/// PID files against it.
const UNSHARE: [&str; 5] = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn as_pid_1_of_its_namespace_the_plugin_reaps_fifty_daemons() {
    if !pid_namespaces_available() {
        return;
    }
    // `--init=auto`, the default: the plugin is PID 1 there, so it runs behind its init.
    let running = start(&UNSHARE, "auto").await;
    let parents = running.cycle(CYCLES).await;
    let namespace_init = *descendants(running.pid())
        .iter()
        .find(|(_, p)| p.parent == running.pid())
        .unwrap()
        .0;
    assert!(
        parents.iter().all(|p| *p == namespace_init),
        "daemons are adopted by PID 1 of the namespace ({namespace_init}): {parents:?}"
    );
    let zombies = zombies_after(running.pid(), Duration::from_secs(5));
    assert!(
        zombies.is_empty(),
        "{} zombies in the namespace, the first: {:?}",
        zombies.len(),
        zombies.first()
    );
}

/// What the init is for, and proof that the zombie count can fail: the same plugin as PID 1
/// without its init (`--init=never`) keeps a zombie for every daemon it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn as_pid_1_without_its_init_the_plugin_keeps_every_daemon_as_a_zombie() {
    if !pid_namespaces_available() {
        return;
    }
    let running = start(&UNSHARE, "never").await;
    running.cycle(3).await;
    let zombies = zombies_after(running.pid(), Duration::ZERO);
    let names: Vec<&str> = zombies.iter().map(|(_, p)| p.name.as_str()).collect();
    assert_eq!(names, ["nvidia-cuda-mps"; 3], "{zombies:?}");
}
