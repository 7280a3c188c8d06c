//! Tests of the flags and of the configuration they resolve to.

use super::*;

fn parse(args: &[&str]) -> Args {
    Args::try_parse_from(std::iter::once("kerf-kubelet-plugin").chain(args.iter().copied()))
        .unwrap()
}

#[test]
fn defaults_follow_the_driver_name() {
    let config = parse(&["--node-name", "node-1", "--driver-name", "gpu.example.com"])
        .into_config()
        .unwrap();
    assert_eq!(
        config.registration_socket,
        PathBuf::from("/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock")
    );
    assert_eq!(
        config.dra_socket,
        PathBuf::from("/var/lib/kubelet/plugins/gpu.example.com/dra.sock")
    );
    assert_eq!(
        config.checkpoint_file,
        PathBuf::from("/var/lib/kubelet/plugins/gpu.example.com/checkpoint.json")
    );
    assert_eq!(config.discovery, Discovery::Nvml);
    assert!(config.publish_resources);
}

#[test]
fn the_pod_uid_names_the_sockets_for_rolling_updates() {
    let uid = "0f3c2a9e-6a52-4c1e-9b3d-2f1e8c7d6b5a";
    let pod = ["--pod-name", "kerf-abc", "--pod-namespace", "kerf-system"];
    let with_uid = |uid: &str| {
        let mut args = vec!["--node-name", "n", "--driver-name", "gpu.example.com"];
        args.extend(pod);
        args.extend(["--pod-uid", uid]);
        parse(&args).into_config()
    };
    let config = with_uid(uid).unwrap();
    assert_eq!(
        config.registration_socket,
        PathBuf::from(format!(
            "/var/lib/kubelet/plugins_registry/gpu.example.com-{uid}-reg.sock"
        ))
    );
    assert_eq!(
        config.dra_socket,
        PathBuf::from(format!(
            "/var/lib/kubelet/plugins/gpu.example.com/dra-{uid}.sock"
        ))
    );
    assert_eq!(
        config.checkpoint_file,
        PathBuf::from("/var/lib/kubelet/plugins/gpu.example.com/checkpoint.json"),
        "both instances share the checkpoint"
    );
    // An empty UID (a downward API without it) keeps the fixed names.
    let config = with_uid("").unwrap();
    assert_eq!(
        config.registration_socket,
        PathBuf::from("/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock")
    );
    assert_eq!(
        config.dra_socket,
        PathBuf::from("/var/lib/kubelet/plugins/gpu.example.com/dra.sock")
    );
    let err = with_uid("../x").unwrap_err().to_string();
    assert!(err.contains("--pod-uid"), "{err}");
}

#[test]
fn health_flags_become_the_health_config() {
    let health = parse(&["--node-name", "n"]).health_config().unwrap();
    assert_eq!(health.check_timeout, Duration::from_secs(30));
    assert_eq!(health.resend_interval, Duration::from_secs(10));
    assert_eq!(health.taint_policy, TaintPolicy::default());
    assert!(!health.mock_annotation);
    let health = parse(&[
        "--node-name",
        "n",
        "--mock-gpus",
        "l4",
        "--mock-fault-file",
        "/tmp/faults.yaml",
        "--health-check-timeout",
        "6s",
        "--additional-xids-to-ignore",
        "94,95",
        "--unhealthy-taint-effect",
        "None",
        "--fatal-taint-effect",
        "NoSchedule",
    ])
    .health_config()
    .unwrap();
    assert_eq!(health.resend_interval, Duration::from_secs(2));
    assert_eq!(health.extra_ignored_xids, [94, 95]);
    assert!(health.mock_annotation);
    assert_eq!(
        health.taint_policy,
        TaintPolicy {
            unhealthy: TaintEffect::None,
            fatal: TaintEffect::NoSchedule
        }
    );
    let err = parse(&["--node-name", "n", "--mock-fault-file", "/f"])
        .health_config()
        .unwrap_err();
    assert!(err.to_string().contains("--mock-fault-file"), "{err}");
    let err = parse(&["--node-name", "n", "--health-check-timeout", "500ms"])
        .health_config()
        .unwrap_err();
    assert!(err.to_string().contains("--health-check-timeout"), "{err}");
    assert!(
        Args::try_parse_from(["x", "--node-name", "n", "--fatal-taint-effect", "Evict"]).is_err()
    );
}

#[test]
fn the_claim_cache_is_on_unless_switched_off() {
    assert!(parse(&["--node-name", "n"]).claim_cache);
    assert!(!parse(&["--node-name", "n", "--claim-cache=false"]).claim_cache);
    assert!(Args::try_parse_from(["x", "--node-name", "n", "--claim-cache=maybe"]).is_err());
}

#[test]
fn hostile_names_are_refused() {
    let err = parse(&["--node-name", "../etc"]).into_config().unwrap_err();
    assert!(err.to_string().contains("--node-name"), "{err}");
    let err = parse(&["--node-name", "n", "--driver-name", "a/b"])
        .into_config()
        .unwrap_err();
    assert!(err.to_string().contains("--driver-name"), "{err}");
}

#[test]
fn mock_flags_exclude_each_other() {
    let err = Args::try_parse_from([
        "x",
        "--node-name",
        "n",
        "--mock-gpus",
        "l4",
        "--mock-inventory",
        "f.yaml",
    ]);
    assert!(err.is_err());
}

#[test]
fn gpu_tools_come_from_the_driver_root_or_an_explicit_mock_root() {
    let real = parse(&["--node-name", "n", "--driver-root", "/run/nvidia/driver"])
        .into_config()
        .unwrap();
    assert_eq!(
        real.gpu_tools_root,
        Some(PathBuf::from("/run/nvidia/driver"))
    );
    assert_eq!(real.mps_root, PathBuf::from("/var/run/kerf/mps"));
    let mock = parse(&["--node-name", "n", "--mock-gpus", "l4"])
        .into_config()
        .unwrap();
    assert_eq!(
        mock.gpu_tools_root, None,
        "mock mode enforces only when asked"
    );
    let faked = parse(&[
        "--node-name",
        "n",
        "--mock-gpus",
        "l4",
        "--mock-driver-root",
        "/opt/kerf/mock-driver",
    ])
    .into_config()
    .unwrap();
    assert_eq!(
        faked.gpu_tools_root,
        Some(PathBuf::from("/opt/kerf/mock-driver"))
    );
    let err = parse(&["--node-name", "n", "--mock-driver-root", "/x"])
        .into_config()
        .unwrap_err();
    assert!(err.to_string().contains("--mock-driver-root"), "{err}");
    let err = parse(&["--node-name", "n", "--mps-root", "relative/mps"])
        .into_config()
        .unwrap_err();
    assert!(err.to_string().contains("--mps-root relative/mps"), "{err}");
}

#[test]
fn dynamic_mig_is_on_by_default_and_static_gpus_are_a_list() {
    let defaults = parse(&["--node-name", "n"]).dynamic_mig_settings();
    assert!(defaults.enabled);
    assert!(defaults.static_gpus.is_empty());
    let set = parse(&[
        "--node-name",
        "n",
        "--dynamic-mig=false",
        "--static-mig-gpus",
        "3,0",
    ])
    .dynamic_mig_settings();
    assert!(!set.enabled);
    assert_eq!(set.static_gpus.into_iter().collect::<Vec<_>>(), vec![0, 3]);
    assert!(Args::try_parse_from(["x", "--node-name", "n", "--static-mig-gpus", "gpu-1"]).is_err());
}

#[test]
fn crash_injection_is_for_mock_mode_only() {
    assert_eq!(parse(&["--node-name", "n"]).mock_crash_at().unwrap(), None);
    let mock = parse(&[
        "--node-name",
        "n",
        "--mock-gpus",
        "a100-40gb-dynmig",
        "--mock-crash-at",
        "after-ci-create",
    ]);
    assert_eq!(
        mock.mock_crash_at().unwrap(),
        Some(CrashStep::AfterCiCreate)
    );
    let err = parse(&["--node-name", "n", "--mock-crash-at", "after-record"])
        .mock_crash_at()
        .unwrap_err();
    assert!(
        err.to_string().contains("--mock-crash-at after-record"),
        "{err}"
    );
    assert!(Args::try_parse_from(["x", "--node-name", "n", "--mock-crash-at", "later"]).is_err());
}

#[test]
fn metrics_address_can_be_disabled_or_must_parse() {
    assert_eq!(
        parse(&["--node-name", "n", "--metrics-address", ""])
            .into_config()
            .unwrap()
            .metrics_address,
        None
    );
    let err = parse(&["--node-name", "n", "--metrics-address", "nope"])
        .into_config()
        .unwrap_err();
    assert!(err.to_string().contains("--metrics-address"), "{err}");
}

#[test]
fn the_inits_child_argument_wins_over_the_users_init() {
    use crate::reaper::{CHILD_ARG, InitMode};
    assert_eq!(parse(&["--node-name", "n"]).init, InitMode::Auto);
    let child = parse(&["--node-name", "n", "--init", "always", CHILD_ARG]);
    assert_eq!(
        child.init,
        InitMode::Child,
        "else the child would start an init again"
    );
}

/// What `kerf-kubelet-plugin` and `kerf-test-plugin` start with comes from the flags alone:
/// the configuration carries health, crash step, dynamic MIG and the connection flags.
#[test]
fn the_config_carries_every_flag_the_plugin_starts_with() {
    let defaults = parse(&["--node-name", "n", "--mock-gpus", "l4"])
        .into_config()
        .unwrap();
    assert!(defaults.claim_device_status && defaults.claim_cache);
    assert!(defaults.dynamic_mig.enabled);
    assert_eq!(defaults.mock_crash_at, None);
    assert!(defaults.health.mock_annotation);
    let config = parse(&[
        "--node-name",
        "n",
        "--mock-gpus",
        "a100-40gb-dynmig",
        "--mock-crash-at",
        "after-record",
        "--health-check-timeout",
        "6s",
        "--dynamic-mig=false",
        "--static-mig-gpus",
        "1",
        "--claim-device-status=false",
        "--claim-cache=false",
    ])
    .into_config()
    .unwrap();
    assert_eq!(config.mock_crash_at, Some(CrashStep::AfterRecord));
    assert_eq!(config.health.check_timeout, Duration::from_secs(6));
    assert!(!config.dynamic_mig.enabled);
    assert_eq!(config.dynamic_mig.static_gpus.len(), 1);
    assert!(!config.claim_device_status && !config.claim_cache);
    // The checks of the health and crash flags are the configuration's checks.
    for bad in [
        ["--mock-fault-file", "/f"],
        ["--health-check-timeout", "500ms"],
        ["--mock-crash-at", "after-record"],
    ] {
        let err = parse(&["--node-name", "n", bad[0], bad[1]])
            .into_config()
            .unwrap_err();
        assert!(err.to_string().contains(bad[0]), "{err}");
    }
}
