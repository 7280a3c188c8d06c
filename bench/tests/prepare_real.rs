//! `prepare-real` with a few claims: the report's fields are there and sane, and the GETs the
//! API server saw agree with what the plugin's claim cache can do. Not a speed test.

use kerf_bench::BenchOptions;

#[test]
fn a_small_real_path_run_reports_shares_and_counts_the_gets_it_saved() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let claims = 12;
    let options = BenchOptions {
        work_dir: work.path().to_owned(),
        prepare_real_claims: claims,
        ..BenchOptions::default()
    };
    let summaries = kerf_bench::run("prepare-real", &options).unwrap();
    let [summary] = summaries.as_slice() else {
        panic!("one summary expected, got {summaries:?}");
    };
    let figure = |key: &str| -> &str {
        summary
            .get(key)
            .unwrap_or_else(|| panic!("{key} missing from {summary}"))
    };
    let number = |key: &str| -> f64 {
        let value = figure(key);
        value
            .parse()
            .unwrap_or_else(|e| panic!("{key}={value} is not a number ({e}) in {summary}"))
    };
    assert!(summary.to_string().starts_with("bench prepare-real "));
    assert!((number("claims") - 12.0).abs() < f64::EPSILON, "{summary}");
    assert!((number("api_latency_ms") - 1.0).abs() < 1e-9, "{summary}");
    for key in [
        "p50_ms",
        "p99_ms",
        "floor_p50_ms",
        "floor_p99_ms",
        "get_p50_ms",
        "api_get_p50_ms",
        "checkpoint_write_p50_ms",
        "rpc_p50_ms",
    ] {
        assert!(number(key) > 0.0, "{key} in {summary}");
    }
    // A GET waits for the API server's latency at least: a lower bound, not a speed.
    assert!(number("api_get_p50_ms") >= 1.0, "{summary}");
    assert!(number("ratio_p99") > 0.0, "{summary}");
    for prefix in ["", "get_"] {
        let shares: Vec<f64> = ["api", "writes", "grpc", "rest"]
            .iter()
            .map(|part| number(&format!("{prefix}share_{part}")))
            .collect();
        for share in &shares {
            assert!((0.0..=1.0).contains(share), "{prefix}shares in {summary}");
        }
        assert!(shares.iter().sum::<f64>() <= 1.0 + 0.01, "{summary}");
    }
    // Unlabelled claims are in no node's watch: every prepare of one GETs it.
    assert!((number("get_gets") - 12.0).abs() < f64::EPSILON);
    assert!(number("get_share_api") > 0.0, "{summary}");
    let hits = number("cache_hits");
    let gets = number("cache_gets");
    assert!((hits + gets - 12.0).abs() < f64::EPSILON, "{summary}");
    // The plugin watches its node's labelled claims (Connections::kube): after the warm-up,
    // every prepare of one comes from its cache, and the API's share is nothing.
    assert_eq!(figure("cache"), "hit", "{}", summary.report());
    assert!((hits - 12.0).abs() < f64::EPSILON, "{summary}");
    assert!(number("share_api").abs() < f64::EPSILON);
    assert!(
        summary.report().contains("claim cache:"),
        "the report says what the cache did"
    );
    // The miss path: claims allocated right before their prepare. kube-scheduler's have no
    // node label, so no node watch ever holds them and each prepare GETs; kerf-controller's
    // race the watch, so they may or may not.
    assert!(number("scheduler_gets") >= 12.0, "{summary}");
    assert!(number("controller_gets") <= 24.0, "{summary}");
    for key in [
        "scheduler_p99_ms",
        "controller_p99_ms",
        "scheduler_ratio_p99",
        "controller_ratio_p99",
    ] {
        assert!(number(key) > 0.0, "{key} in {summary}");
    }
    // The miss floor holds a GET: at least the API server's latency more than the floor.
    assert!(number("miss_floor_p50_ms") >= 1.0, "{summary}");
    assert!(["met", "missed"].contains(&figure("miss_ratio_p99_target")));
    // The tail runs, each a plugin of its own: status writer off, files on a tmpfs, a busy disk.
    for name in ["status_off", "tmpfs", "disk_load"] {
        assert!(
            number(&format!("{name}_p99_ms")) > 0.0,
            "{name} in {summary}"
        );
        assert!(
            number(&format!("{name}_floor_p99_ms")) > 0.0,
            "{name} in {summary}"
        );
    }
    assert!(number("disk_load_writes_per_s") > 0.0, "{summary}");
}
