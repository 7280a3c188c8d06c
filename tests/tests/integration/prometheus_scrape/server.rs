//! A real Prometheus for the scrape test: found on `$KERF_TEST_PROMETHEUS` or `PATH`, run on a
//! free port with a generated configuration in a temporary directory, and asked through its
//! HTTP API (plain HTTP/1.0 over a TCP stream: no client library needed for three GETs).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The `prometheus` binary: `$KERF_TEST_PROMETHEUS`, else the first on `PATH`.
pub fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KERF_TEST_PROMETHEUS") {
        return Some(PathBuf::from(path));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("prometheus"))
        .find(|path| path.is_file())
}

/// A free TCP port on the loopback address (free when asked; the caller binds it soon).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running Prometheus, killed when dropped.
pub struct Prometheus {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts `binary` scraping every second each `(job, port)` of `targets` on 127.0.0.1,
    /// and waits until its API answers.
    pub async fn start(binary: &Path, targets: &[(&str, u16)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n",
        );
        for (job, port) in targets {
            let _ = write!(
                config,
                "  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
            );
        }
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config).unwrap();
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()));
        let prometheus = Prometheus { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while get(port, "/-/ready")
            .await
            .is_none_or(|(status, _)| status != 200)
        {
            assert!(
                Instant::now() < deadline,
                "prometheus not ready after 30 s: {}",
                prometheus.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        prometheus
    }

    /// Prometheus's own log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The result of instant query `query` (`data.result`), or the error Prometheus gave.
    pub async fn query(&self, query: &str) -> Result<Vec<Value>, String> {
        let path = format!("/api/v1/query?query={}", encode(query));
        let (status, body) = get(self.port, &path)
            .await
            .ok_or_else(|| "no answer".to_owned())?;
        let body: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        if status != 200 || body["status"] != "success" {
            return Err(format!("{status}: {body}"));
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}

/// GETs `path` from 127.0.0.1:`port`: the status and the body.
pub async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.ok()?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The vector selectors of `expr` that name kerf's metrics or `up`: the metric name and its
/// label matchers as written (`name{…}`). Enough PromQL for the dashboard and the rules:
/// function names, keywords and label names are never `kerf_…` or `up` followed by `{` or a
/// non-name character.
pub fn selectors(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let is_name = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !is_name(bytes[i]) || (i > 0 && is_name(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_name(bytes[i]) {
            i += 1;
        }
        let name = &expr[start..i];
        if !(name.starts_with("kerf_") || name == "up") {
            continue;
        }
        if bytes.get(i) == Some(&b'(') {
            continue;
        }
        let mut selector = name.to_owned();
        if bytes.get(i) == Some(&b'{') {
            let end = expr[i..].find('}').map_or(expr.len(), |e| i + e + 1);
            selector.push_str(&expr[i..end]);
            i = end;
        }
        out.push(selector);
    }
    out
}

#[test]
fn selectors_are_the_metrics_with_their_matchers() {
    assert_eq!(
        selectors(
            r#"sum by (le) (rate(kerf_a_bucket{x="y"}[5m])) / on() kerf_b > bool 0 or absent(up{job=~".*k.*"} == 1)"#
        ),
        [r#"kerf_a_bucket{x="y"}"#, "kerf_b", r#"up{job=~".*k.*"}"#]
    );
    assert_eq!(encode("a b{c=\"d\"}"), "a%20b%7Bc%3D%22d%22%7D");
}
