//! A foreign gRPC client on the plugin's real sockets: Python grpcio (gRPC C-core), whose
//! HTTP/2 stack shares nothing with h2 and whose `:authority` on a Unix socket is a path.
//!
//! grpcio 1.57 and later send, for a target `unix:/a/b.sock`, `:authority: a%2Fb.sock` (the
//! path percent-encoded, its leading slash dropped), or `grpc.default_authority` when it is
//! set; h2 alone refuses every one of these with RST_STREAM PROTOCOL_ERROR. The plugin serves
//! its sockets through `kerf_h2_authority::LenientAuthority`; this test shows that it then
//! answers a client that is not kerf's own: the registration calls (GetInfo,
//! NotifyRegistrationStatus) and the DRA v1 calls (NodePrepareResources,
//! NodeUnprepareResources), with `grpc.default_authority` set to the socket path, set to the
//! percent-encoded path, and unset. Several calls go over each connection, because grpcio
//! puts `:authority` in its HPACK dynamic table on the first request and names it by
//! index in every later one.
//!
//! The script (`tests/python/grpcio_client.py`) makes generic calls with raw bytes; requests
//! are encoded and responses decoded here with prost, so nothing is generated for Python.
//!
//! The interpreter is `$KERF_TEST_PYTHON`, else `python3`. Under `CI=true` a missing
//! interpreter or grpcio fails the test; elsewhere it is skipped with the reason printed
//! (`.ci/run` installs grpcio in a venv and sets `KERF_TEST_PYTHON`).

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{DRIVER, NODE, TestNode, cdi_spec_file, uid};
use kerf_proto::dra::v1;
use kerf_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse, registration_server,
};
use kerf_proto::service_names;
use kerf_tests::podman::read_in_background;
use prost::Message as _;
use serde_json::{Value, json};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/python/grpcio_client.py");
/// Names the interpreter to use, e.g. a venv's `bin/python` with grpcio installed.
const PYTHON_ENV: &str = "KERF_TEST_PYTHON";
/// The whole script's limit: each of its calls has 30 s, and the ones that fail without
/// the adapter fail at once.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(240);

/// An interpreter with grpcio, checked to import it.
struct Python {
    interpreter: OsString,
    grpcio: String,
}

impl Python {
    /// The interpreter of `$KERF_TEST_PYTHON` or `python3`, if it runs and imports grpcio.
    fn detect() -> Result<Python, String> {
        let interpreter = std::env::var_os(PYTHON_ENV).unwrap_or_else(|| "python3".into());
        let shown = interpreter.to_string_lossy().into_owned();
        let output = Command::new(&interpreter)
            .args(["-c", "import grpc, sys; sys.stdout.write(grpc.__version__)"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{shown} (${PYTHON_ENV} or python3) cannot be started: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "{shown} cannot import grpc ({}); `pip install grpcio` or set ${PYTHON_ENV} \
                 to a Python that has it: {}",
                output.status,
                // The traceback's last line says what is missing.
                String::from_utf8_lossy(&output.stderr)
                    .lines()
                    .rfind(|line| !line.trim().is_empty())
                    .unwrap_or("")
                    .trim()
            ));
        }
        Ok(Python {
            interpreter,
            grpcio: String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        })
    }

    /// Runs the script with `input` on stdin; its stdout as JSON.
    fn run_script(&self, input: &Value) -> Value {
        let mut child = Command::new(&self.interpreter)
            .arg(SCRIPT)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {SCRIPT}: {e}"));
        // Readers on their own threads, so that a chatty grpcio cannot block on a full pipe.
        let stdout = read_in_background(child.stdout.take().unwrap());
        let stderr = read_in_background(child.stderr.take().unwrap());
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.to_string().as_bytes()).unwrap();
        drop(stdin);
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > SCRIPT_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{SCRIPT} did not finish in {SCRIPT_TIMEOUT:?}; stderr: {}",
                    stderr.join().unwrap()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
        assert!(
            status.success(),
            "{SCRIPT} failed ({status}); stdout: {stdout}; stderr: {stderr}"
        );
        serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!("{SCRIPT} printed no JSON ({e}): {stdout}; stderr: {stderr}")
        })
    }
}

/// grpcio, or `None` after printing why the test is skipped. Under `CI=true` a missing
/// Python or grpcio is a failure: the CI must run this test, not skip it.
fn python_or_skip(test: &str) -> Option<Python> {
    match Python::detect() {
        Ok(python) => Some(python),
        Err(reason) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("{test}: CI=true but no Python with grpcio: {reason}")
        }
        Err(reason) => {
            eprintln!("SKIPPED {test}: {reason} (under CI=true this fails)");
            None
        }
    }
}

/// Percent-encodes every byte but RFC 3986's unreserved characters, as grpc C-core encodes
/// a `unix:` target's path into its default authority.
fn percent_encode(path: &Path) -> String {
    let mut out = String::new();
    for &b in path.as_os_str().as_encoded_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            write!(out, "%{b:02X}").unwrap();
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut out, b| {
        write!(out, "{b:02x}").unwrap();
        out
    })
}

fn unhex(text: &str) -> Vec<u8> {
    assert!(text.len().is_multiple_of(2), "odd hex length: {text}");
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Socket {
    Registration,
    Dra,
}

impl Socket {
    fn key(self) -> &'static str {
        match self {
            Socket::Registration => "registration",
            Socket::Dra => "dra",
        }
    }
}

/// What a call's response must be.
#[derive(Debug)]
enum Expect {
    /// The plugin's registration info.
    Info,
    /// The empty answer to NotifyRegistrationStatus.
    Acknowledged,
    /// The claim prepared on the named device.
    Prepared { claim: Claim, device: String },
    /// The claim unprepared.
    Unprepared { claim: Claim },
}

#[derive(Debug)]
struct Call {
    socket: Socket,
    method: String,
    request: Vec<u8>,
    expect: Expect,
}

fn registration_method(method: &str) -> String {
    format!("/{}/{method}", registration_server::SERVICE_NAME)
}

fn dra_method(method: &str) -> String {
    format!("/{}/{method}", v1::dra_plugin_server::SERVICE_NAME)
}

/// Claims are named as the kubelet names them on the wire, so this test depends on no
/// helper's claim type.
type Claim = v1::Claim;

fn v1_claims(claim: &Claim) -> Vec<v1::Claim> {
    vec![claim.clone()]
}

/// The calls of one configuration: three on each connection, so that the second and third
/// request of each refer to `:authority` by HPACK dynamic index. The claim is prepared,
/// unprepared and prepared again, so the last prepare writes its spec anew and the test
/// can see it on disk.
fn calls(claim: &Claim, device: &str) -> Vec<Call> {
    let get_info = || Call {
        socket: Socket::Registration,
        method: registration_method("GetInfo"),
        request: InfoRequest {}.encode_to_vec(),
        expect: Expect::Info,
    };
    let prepare = || Call {
        socket: Socket::Dra,
        method: dra_method("NodePrepareResources"),
        request: v1::NodePrepareResourcesRequest {
            claims: v1_claims(claim),
        }
        .encode_to_vec(),
        expect: Expect::Prepared {
            claim: claim.clone(),
            device: device.to_owned(),
        },
    };
    vec![
        get_info(),
        Call {
            socket: Socket::Registration,
            method: registration_method("NotifyRegistrationStatus"),
            request: RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            }
            .encode_to_vec(),
            expect: Expect::Acknowledged,
        },
        get_info(),
        prepare(),
        Call {
            socket: Socket::Dra,
            method: dra_method("NodeUnprepareResources"),
            request: v1::NodeUnprepareResourcesRequest {
                claims: v1_claims(claim),
            }
            .encode_to_vec(),
            expect: Expect::Unprepared {
                claim: claim.clone(),
            },
        },
        prepare(),
    ]
}

/// Decodes a response and checks it against what the call expects.
fn check(call: &Call, response: &[u8], node: &TestNode, context: &str) {
    match &call.expect {
        Expect::Info => {
            let info = PluginInfo::decode(response).unwrap();
            assert_eq!(info.r#type, service_names::DRA_PLUGIN_TYPE, "{context}");
            assert_eq!(info.name, DRIVER, "{context}");
            assert_eq!(
                Path::new(&info.endpoint),
                node.config().dra_socket,
                "{context}"
            );
            assert_eq!(
                info.supported_versions,
                [
                    service_names::DRA_V1,
                    service_names::DRA_V1BETA1,
                    service_names::HEALTH_V1ALPHA1
                ],
                "{context}"
            );
        }
        Expect::Acknowledged => {
            assert_eq!(
                RegistrationStatusResponse::decode(response).unwrap(),
                RegistrationStatusResponse {},
                "{context}"
            );
        }
        Expect::Prepared { claim, device } => {
            let response = v1::NodePrepareResourcesResponse::decode(response).unwrap();
            assert_eq!(response.claims.len(), 1, "{context}: {response:?}");
            let result = &response.claims[&claim.uid];
            assert_eq!(result.error, "", "{context}: per-claim error");
            assert_eq!(result.devices.len(), 1, "{context}: {result:?}");
            let prepared = &result.devices[0];
            assert_eq!(&prepared.device_name, device, "{context}");
            assert_eq!(prepared.pool_name, NODE, "{context}");
            assert_eq!(prepared.request_names, ["gpu"], "{context}");
            assert_eq!(
                prepared.cdi_device_ids,
                [format!("k8s.{DRIVER}/gpu={}-{device}", claim.uid)],
                "{context}"
            );
        }
        Expect::Unprepared { claim } => {
            let response = v1::NodeUnprepareResourcesResponse::decode(response).unwrap();
            assert_eq!(response.claims.len(), 1, "{context}: {response:?}");
            assert_eq!(
                response.claims[&claim.uid].error, "",
                "{context}: per-claim error"
            );
        }
    }
}

/// One configuration of the client: its name, what `grpc.default_authority` is per socket
/// (`None`: unset), its claim on its own GPU, and its calls.
struct Configuration {
    name: &'static str,
    authority: Option<[String; 2]>,
    claim: Claim,
    gpu_minor: u32,
    calls: Vec<Call>,
}

/// The three configurations, each with a claim allocated to the node on GPU 1, 2 and 3.
fn configurations(node: &TestNode) -> Vec<Configuration> {
    let config = node.config();
    let (registration, dra) = (config.registration_socket, config.dra_socket);
    let configuration = |n: u32, name, authority| {
        let device = format!("gpu-{n}");
        let stored = node.device_claim(&format!("grpcio-{n}"), &uid(n), &device);
        let claim = Claim {
            namespace: stored.namespace,
            uid: stored.uid,
            name: stored.name,
        };
        let calls = calls(&claim, &device);
        Configuration {
            name,
            authority,
            claim,
            gpu_minor: n,
            calls,
        }
    };
    vec![
        configuration(
            1,
            "grpc.default_authority = socket path",
            Some([
                registration.to_string_lossy().into_owned(),
                dra.to_string_lossy().into_owned(),
            ]),
        ),
        configuration(
            2,
            "grpc.default_authority = percent-encoded socket path",
            Some([percent_encode(&registration), percent_encode(&dra)]),
        ),
        configuration(
            3,
            "grpc.default_authority unset (grpcio's own, from the unix: target)",
            None,
        ),
    ]
}

/// What the script reads on stdin (its docstring describes the format).
fn script_input(node: &TestNode, configurations: &[Configuration]) -> Value {
    let config = node.config();
    json!({
        "sockets": {
            (Socket::Registration.key()): config.registration_socket,
            (Socket::Dra.key()): config.dra_socket,
        },
        "configurations": configurations.iter().map(|c| json!({
            "name": c.name,
            "authority": c.authority.as_ref().map(|[reg, dra]| json!({
                (Socket::Registration.key()): reg,
                (Socket::Dra.key()): dra,
            })),
            "calls": c.calls.iter().map(|call| json!({
                "socket": call.socket.key(),
                "method": call.method,
                "request": hex(&call.request),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// Checks that every call succeeded, then every response.
fn check_report(report: &Value, configurations: &[Configuration], node: &TestNode) {
    let results = report["configurations"].as_array().unwrap();
    assert_eq!(results.len(), configurations.len(), "{report}");
    // Every failure first, so that one message shows the whole pattern.
    let mut failures = Vec::new();
    for (configuration, result) in configurations.iter().zip(results) {
        assert_eq!(result["name"], configuration.name, "{report}");
        let outcomes = result["results"].as_array().unwrap();
        assert_eq!(outcomes.len(), configuration.calls.len(), "{report}");
        for (index, (call, outcome)) in configuration.calls.iter().zip(outcomes).enumerate() {
            if outcome["ok"] != true {
                failures.push(format!(
                    "{}: call {} {} on the {} socket: {} {}",
                    configuration.name,
                    index + 1,
                    call.method,
                    call.socket.key(),
                    outcome["code"],
                    outcome["details"]
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "grpcio {} calls failed:\n{}",
        report["grpcio"],
        failures.join("\n")
    );
    for (configuration, result) in configurations.iter().zip(results) {
        let outcomes = result["results"].as_array().unwrap();
        for (index, (call, outcome)) in configuration.calls.iter().zip(outcomes).enumerate() {
            let context = format!("{}: call {} {}", configuration.name, index + 1, call.method);
            let response = unhex(outcome["response"].as_str().unwrap());
            check(call, &response, node, &context);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_registers_prepares_and_unprepares_whatever_authority_it_sends() {
    let test = "grpcio_registers_prepares_and_unprepares_whatever_authority_it_sends";
    let Some(python) = python_or_skip(test) else {
        return;
    };
    eprintln!(
        "{test}: grpcio {} under {}",
        python.grpcio,
        python.interpreter.to_string_lossy()
    );
    let node = TestNode::new("h100-sxm-80gb");
    let configurations = configurations(&node);
    let input = script_input(&node, &configurations);
    let plugin = node.start_plugin().await;
    // The plugin serves on this process's runtime; the script blocks a thread of its own.
    let report = tokio::task::spawn_blocking(move || python.run_script(&input))
        .await
        .unwrap();
    check_report(&report, &configurations, &node);

    // The last call of each configuration prepared its claim anew: its spec is on disk.
    let mut expected_files: Vec<String> = configurations
        .iter()
        .map(|c| cdi_spec_file(&c.claim.uid))
        .collect();
    expected_files.sort();
    assert_eq!(node.cdi_files(), expected_files);
    for configuration in &configurations {
        let spec = node.cdi_spec(&configuration.claim.uid).to_string();
        let device_node = format!("\"/dev/nvidia{}\"", configuration.gpu_minor);
        assert!(spec.contains(&device_node), "{device_node} in {spec}");
    }
    assert_eq!(
        node.checkpoint_claims(),
        [1, 2, 3]
            .map(|n| (uid(n), "PrepareCompleted".to_owned()))
            .to_vec()
    );
    plugin.shutdown().await.unwrap();
}
