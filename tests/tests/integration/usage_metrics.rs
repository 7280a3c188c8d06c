//! What the usage metrics say about a known cluster, read from the controller's `/metrics`
//! (the scenario of `prometheus_scrape`, without Prometheus): the claim that fits holds 1 GiB
//! and its MPS compute share of one GPU, counted for its GPU, its class and its namespace; the
//! claim that cannot fit waits; the pod of the first was seen waiting and is timed.

use std::time::{Duration, Instant};

use kerf_tests::fake_api::FakeApi;
use tokio_util::sync::CancellationToken;

use crate::prometheus_scrape::server::{free_port, get};
use crate::prometheus_scrape::{cluster, start_controller};

const GIB: f64 = 1_073_741_824.0;

/// Samples of the families named `name` in `text`, with their labels as written.
fn samples<'a>(text: &'a str, name: &str) -> Vec<(&'a str, f64)> {
    text.lines()
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let labels = series.strip_prefix(name)?;
            (labels.is_empty() || labels.starts_with('{'))
                .then(|| Some((labels, value.parse().ok()?)))?
        })
        .collect()
}

/// The one sample of `name` whose labels contain `labels`.
fn value(text: &str, name: &str, labels: &str) -> Option<f64> {
    let found: Vec<f64> = samples(text, name)
        .into_iter()
        .filter(|(l, _)| l.contains(labels))
        .map(|(_, v)| v)
        .collect();
    (found.len() == 1).then(|| found[0])
}

/// What is not (yet) as expected in `text`.
fn unmet(text: &str) -> Vec<String> {
    let mut wrong = Vec::new();
    let mut expect = |what: &str, got: Option<f64>, want: f64| {
        if got.is_none_or(|g| (g - want).abs() > 1e-9) {
            wrong.push(format!("{what}: {got:?}, want {want}"));
        }
    };
    let allocated: Vec<(&str, f64)> = samples(text, "kerf_controller_gpu_memory_allocated_bytes")
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .collect();
    expect(
        "GPUs with memory allocated",
        Some(f64::from(u32::try_from(allocated.len()).unwrap())),
        1.0,
    );
    expect("their memory", allocated.first().map(|(_, v)| *v), GIB);
    let slices: f64 = samples(text, "kerf_controller_gpu_allocated_slices")
        .iter()
        .map(|(_, v)| v)
        .sum();
    expect("slices on all GPUs", Some(slices), 1.0);
    expect(
        "GPUs published",
        Some(f64::from(
            u32::try_from(samples(text, "kerf_controller_gpu_memory_bytes").len()).unwrap(),
        )),
        32.0,
    );
    for (name, labels) in [
        (
            "kerf_controller_class_memory_allocated_bytes",
            r#"class="slices""#,
        ),
        (
            "kerf_controller_namespace_memory_allocated_bytes",
            r#"namespace="default""#,
        ),
    ] {
        expect(name, value(text, name, labels), GIB);
    }
    expect(
        "namespace slices",
        value(
            text,
            "kerf_controller_namespace_allocated_slices",
            r#"namespace="default""#,
        ),
        1.0,
    );
    expect(
        "waiting claims",
        value(text, "kerf_controller_unallocated_claims", ""),
        1.0,
    );
    expect(
        "timed pods",
        value(
            text,
            "kerf_controller_pod_allocation_duration_seconds_count",
            "",
        ),
        1.0,
    );
    let product = r#"product="NVIDIA H100 80GB HBM3""#;
    if !allocated
        .iter()
        .all(|(labels, _)| labels.contains(product) && labels.contains(r#"uuid="GPU-"#))
    {
        wrong.push(format!("GPU labels: {allocated:?}"));
    }
    wrong
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_gpu_class_and_namespace_holds_what_its_claims_were_allocated() {
    let fake = FakeApi::new();
    cluster(&fake);
    let shutdown = CancellationToken::new();
    let port = free_port();
    start_controller(&fake, port, &shutdown);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = get(port, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default();
        let wrong = unmet(&text);
        if wrong.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "{wrong:#?}\n{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
}
