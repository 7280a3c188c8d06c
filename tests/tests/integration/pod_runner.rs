//! The pod runner (`kerf_tests::pod_runner`): pods bound to its node run as local processes,
//! with the kubelet's status, restarts and graceful deletion, against FakeApi.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kerf_tests::fake_api::FakeApi;
use kerf_tests::pod_runner::{PodRunner, PodRunnerSettings, UnemulatedMount};
use kerf_tests::wait::eventually;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};

const NODE: &str = "node-a";
const NS: &str = "default";
const PATIENCE: Duration = Duration::from_secs(20);

fn runner(fake: &FakeApi, logs: &Path, initial_backoff: Duration) -> PodRunner {
    let programs = BTreeMap::from([("/bin/sh".to_owned(), PathBuf::from("/bin/sh"))]);
    let settings = PodRunnerSettings {
        initial_backoff,
        max_backoff: initial_backoff * 4,
        volume_retry: Duration::from_millis(50),
        log_dir: logs.to_owned(),
        ..PodRunnerSettings::default()
    };
    PodRunner::start(fake, NODE, programs, settings)
}

/// A pod on [`NODE`] whose one container runs `script` under `/bin/sh -c`.
fn shell_pod(name: &str, script: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "nodeName": NODE,
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "main",
                "image": "example.com/shell:1",
                "command": ["/bin/sh", "-c", script],
            }],
        },
    })
}

async fn create(fake: &FakeApi, pod: Value) -> Pod {
    let pod: Pod = serde_json::from_value(pod).unwrap();
    pods(fake)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap()
}

fn pods(fake: &FakeApi) -> Api<Pod> {
    Api::namespaced(fake.client(), NS)
}

/// The pod's stored status as JSON (null while it has none or the pod is gone).
async fn status(fake: &FakeApi, name: &str) -> Value {
    match pods(fake).get_opt(name).await.unwrap() {
        Some(pod) => serde_json::to_value(pod.status).unwrap(),
        None => Value::Null,
    }
}

async fn status_where(
    fake: &FakeApi,
    name: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    eventually(what, PATIENCE, || async {
        let status = status(fake, name).await;
        check(&status).then_some(status)
    })
    .await
}

fn container(status: &Value) -> &Value {
    &status["containerStatuses"][0]
}

fn running_container(status: &Value) -> bool {
    status["phase"] == "Running" && container(status)["state"]["running"].is_object()
}

/// Whether `pid` is a live process (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit(')')
            .next()
            .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
    })
}

fn kill9(pid: u32) {
    let pid = rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
}

/// Waits until pod `p`'s shell has set its trap and said `ready`: a SIGTERM before that
/// would end it by the default action, on a real node too.
async fn trap_set(runner: &PodRunner) {
    let log = runner.log_path(NS, "p", "main").unwrap();
    eventually("the trap set", PATIENCE, || async {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|text| text.contains("ready"))
    })
    .await;
}

#[tokio::test]
async fn a_pod_runs_with_its_environment_and_reports_running() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeApi::new();
    let runner = runner(&fake, dir.path(), Duration::from_millis(100));
    let mut pod = shell_pod(
        "p",
        "echo \"$X on $NODE as $(echo $HOSTNAME)\"; exec sleep 30",
    );
    pod["spec"]["containers"][0]["env"] = json!([
        {"name": "X", "value": "hello"},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]);
    let created = create(&fake, pod).await;

    let status = status_where(&fake, "p", "the pod running", running_container).await;
    let main = container(&status);
    assert_eq!(main["name"], "main");
    assert_eq!(main["image"], "example.com/shell:1");
    assert_eq!(main["ready"], true);
    assert_eq!(main["started"], true);
    assert_eq!(main["restartCount"], 0);
    let uid = created.metadata.uid.unwrap();
    assert_eq!(main["containerID"], format!("fake://{uid}/main/0"));
    assert!(main["state"]["running"]["startedAt"].is_string());
    assert_eq!(
        status["conditions"][0],
        json!({"type": "Ready", "status": "True", "lastTransitionTime": status["conditions"][0]["lastTransitionTime"]})
    );

    let pid = runner.pid(NS, "p").expect("a process");
    assert!(alive(pid));
    let log = runner.log_path(NS, "p", "main").unwrap();
    let text = eventually("the log", PATIENCE, || async {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|t| t.ends_with('\n'))
    })
    .await;
    assert_eq!(text, "hello on node-a as p\n", "{}", runner.logs(NS, "p"));

    runner.stop().await;
    eventually("the process killed by stop()", PATIENCE, || async {
        (!alive(pid)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_killed_container_is_restarted_with_a_new_id_then_backs_off() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeApi::new();
    // A back-off long enough to be seen while it lasts.
    let runner = runner(&fake, dir.path(), Duration::from_secs(2));
    create(&fake, shell_pod("p", "exec sleep 30")).await;
    let first = status_where(&fake, "p", "the pod running", running_container).await;
    let first_pid = runner.pid(NS, "p").unwrap();

    kill9(first_pid);
    // The first exit restarts at once (flowcontrol.Backoff has no entry yet).
    let second = status_where(&fake, "p", "the first restart", |s| {
        running_container(s) && container(s)["restartCount"] == 1
    })
    .await;
    assert_ne!(
        container(&second)["containerID"],
        container(&first)["containerID"]
    );
    let last = &container(&second)["lastState"]["terminated"];
    assert_eq!(last["exitCode"], 137);
    assert_eq!(last["reason"], "Error");
    assert_eq!(last["containerID"], container(&first)["containerID"]);
    let second_pid = runner.pid(NS, "p").unwrap();
    assert_ne!(second_pid, first_pid);
    assert!(!alive(first_pid));

    kill9(second_pid);
    let waiting = status_where(&fake, "p", "CrashLoopBackOff", |s| {
        container(s)["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    })
    .await;
    let message = container(&waiting)["state"]["waiting"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.starts_with("back-off 2s restarting failed container=main pod=p_default("),
        "{message}"
    );
    assert_eq!(container(&waiting)["ready"], false);
    assert_eq!(waiting["phase"], "Running");
    assert_eq!(runner.pid(NS, "p"), None);
    status_where(&fake, "p", "the second restart", |s| {
        running_container(s) && container(s)["restartCount"] == 2
    })
    .await;
    assert!(runner.problems().is_empty(), "{:?}", runner.problems());
}

#[tokio::test]
async fn a_deleted_pod_gets_sigterm_and_is_then_deleted_by_the_runner() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeApi::new();
    let runner = runner(&fake, dir.path(), Duration::from_millis(100));
    let marker = dir.path().join("terminated");
    let script = format!(
        "trap 'echo term > {}; exit 0' TERM; echo ready; sleep 30 & wait",
        marker.display()
    );
    create(&fake, shell_pod("p", &script)).await;
    status_where(&fake, "p", "the pod running", running_container).await;
    let pid = runner.pid(NS, "p").unwrap();
    trap_set(&runner).await;

    let answer = pods(&fake)
        .delete("p", &DeleteParams::default())
        .await
        .unwrap();
    // kube-apiserver's graceful deletion: the pod stays, marked, with the spec's grace.
    let marked = answer.left().expect("the pod, still there");
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert_eq!(marked.metadata.deletion_grace_period_seconds, Some(5));

    eventually("the pod deleted by the runner", PATIENCE, || async {
        pods(&fake)
            .get_opt("p")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "term\n");
    assert!(!alive(pid));
    assert!(runner.problems().is_empty(), "{:?}", runner.problems());
    let deletes: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.verb == "delete")
        .map(|r| r.path)
        .collect();
    assert_eq!(
        deletes.len(),
        2,
        "the user's delete, then the runner's: {deletes:?}"
    );
}

#[tokio::test]
async fn a_container_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeApi::new();
    let runner = runner(&fake, dir.path(), Duration::from_millis(100));
    let script = "trap '' TERM; echo ready; sleep 30 & wait; sleep 30";
    create(&fake, shell_pod("p", script)).await;
    status_where(&fake, "p", "the pod running", running_container).await;
    let pid = runner.pid(NS, "p").unwrap();
    trap_set(&runner).await;
    let params = DeleteParams {
        grace_period_seconds: Some(1),
        ..DeleteParams::default()
    };
    pods(&fake).delete("p", &params).await.unwrap();
    eventually("the pod deleted by the runner", PATIENCE, || async {
        pods(&fake)
            .get_opt("p")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(!alive(pid));
}

#[tokio::test]
async fn an_unbound_pod_is_deleted_at_once() {
    let fake = FakeApi::new();
    fake.graceful_pod_deletion_on(NODE);
    let mut pod = shell_pod("unbound", "true");
    pod["spec"].as_object_mut().unwrap().remove("nodeName");
    create(&fake, pod).await;
    pods(&fake)
        .delete("unbound", &DeleteParams::default())
        .await
        .unwrap();
    assert!(pods(&fake).get_opt("unbound").await.unwrap().is_none());
}

#[tokio::test]
async fn pods_the_runner_cannot_run_wait_with_the_reason_and_no_process() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeApi::new();
    let runner = runner(&fake, dir.path(), Duration::from_millis(100));
    let mut unknown = shell_pod("unknown", "");
    unknown["spec"]["containers"][0]["command"] = json!(["/usr/local/bin/nowhere", "--flag"]);
    create(&fake, unknown).await;
    let mut scratch = shell_pod("scratch", "exec sleep 30");
    scratch["spec"]["volumes"] = json!([{"name": "scratch", "emptyDir": {}}]);
    create(&fake, scratch).await;
    let mut downward = shell_pod("downward", "exec sleep 30");
    downward["spec"]["containers"][0]["env"] =
        json!([{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]);
    create(&fake, downward).await;

    for (name, reason, words) in [
        ("unknown", "ErrImagePull", "/usr/local/bin/nowhere"),
        ("scratch", "CreateContainerConfigError", "emptyDir"),
        ("downward", "CreateContainerConfigError", "status.podIP"),
    ] {
        let status = status_where(&fake, name, reason, |s| {
            container(s)["state"]["waiting"]["reason"] == reason
        })
        .await;
        assert_eq!(status["phase"], "Pending");
        let message = container(&status)["state"]["waiting"]["message"]
            .as_str()
            .unwrap();
        assert!(message.contains(words), "{name}: {message}");
        assert_eq!(runner.pid(NS, name), None);
    }
    // Deleted, such a pod goes at once: it has nothing to stop.
    pods(&fake)
        .delete("unknown", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the pod deleted by the runner", PATIENCE, || async {
        pods(&fake)
            .get_opt("unknown")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn host_path_volumes_are_checked_created_and_their_other_mounts_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeApi::new();
    let runner = runner(&fake, &dir.path().join("logs"), Duration::from_millis(100));
    let made = dir.path().join("made");
    let missing = dir.path().join("missing");
    let shm = dir.path().join("shm");
    let mut pod = shell_pod("p", "exec sleep 30");
    pod["spec"]["volumes"] = json!([
        {"name": "made", "hostPath": {"path": made, "type": "DirectoryOrCreate"}},
        {"name": "missing", "hostPath": {"path": missing, "type": "Directory"}},
        {"name": "shm", "hostPath": {"path": shm, "type": "DirectoryOrCreate"}},
    ]);
    pod["spec"]["containers"][0]["volumeMounts"] = json!([
        {"name": "made", "mountPath": made},
        {"name": "missing", "mountPath": missing},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]);
    create(&fake, pod).await;

    let status = status_where(&fake, "p", "the failed mount", |s| {
        container(s)["state"]["waiting"]["reason"] == "ContainerCreating"
            && container(s)["state"]["waiting"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
    })
    .await;
    let message = container(&status)["state"]["waiting"]["message"]
        .as_str()
        .unwrap();
    assert!(
        message.contains(&format!(
            "hostPath type check failed: {} is not a directory",
            missing.display()
        )),
        "{message}"
    );
    assert!(made.is_dir());
    assert_eq!(runner.pid(NS, "p"), None);

    // The kubelet's volume manager retries: the pod starts once the directory is there.
    std::fs::create_dir(&missing).unwrap();
    status_where(&fake, "p", "the pod running", running_container).await;
    assert_eq!(
        runner.unemulated_mounts(),
        vec![UnemulatedMount {
            namespace: NS.to_owned(),
            pod: "p".to_owned(),
            container: "main".to_owned(),
            volume: "shm".to_owned(),
            host_path: shm,
            mount_path: "/dev/shm".to_owned(),
        }]
    );
}
