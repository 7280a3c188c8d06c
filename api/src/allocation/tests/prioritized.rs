//! `claim_request` and `claim_allocation_status` for `firstAvailable`, tolerations and admin
//! access.

use super::*;

fn sub(name: &str, class: &str) -> Value {
    json!({ "name": name, "deviceClassName": class })
}

fn prioritized(subs: &[Value]) -> Value {
    json!([{ "name": "gpu", "firstAvailable": subs }])
}

#[test]
fn first_available_subrequests_become_alternatives_named_parent_sub() {
    let configs = json!([
        config(&[], &json!({ "sharing": "MPS" })),
        config(&["gpu/big"], &json!({ "memory": "20Gi" })),
        config(&["gpu/small"], &json!({ "memory": "10Gi" })),
        config(&["gpu"], &json!({ "compute": 30 })),
    ]);
    let claim = request_of(
        &prioritized(&[sub("big", "slices"), sub("small", "slices")]),
        &configs,
    )
    .unwrap();
    let [parent] = claim.requests.as_slice() else {
        panic!("{:?}", claim.requests)
    };
    assert_eq!(parent.name, "gpu");
    let subs: Vec<(&str, Option<u64>, Option<u8>, Sharing)> = parent
        .first_available
        .iter()
        .map(|s| {
            (
                s.name.as_str(),
                s.slice.map(|x| x.memory_bytes),
                s.slice.map(|x| x.compute_percent),
                s.sharing,
            )
        })
        .collect();
    assert_eq!(
        subs,
        [
            ("gpu/big", Some(20 * GI), Some(30), Sharing::Mps),
            ("gpu/small", Some(10 * GI), Some(30), Sharing::Mps),
        ]
    );
}

#[test]
fn first_available_errors_name_the_field() {
    let cases = [
        (
            prioritized(&[sub("a", "slices"), sub("a", "plain")]),
            "spec.devices.requests[0].firstAvailable[1].name: \"a\" must be set and unique",
        ),
        (
            prioritized(&[sub("a", "slices"), sub("b", "nvidia")]),
            "spec.devices.requests[0].firstAvailable[1].deviceClassName: \"nvidia\" has no GpuClassParameters",
        ),
        (
            prioritized(&[]),
            "spec.devices.requests[0].firstAvailable: 0 subrequests",
        ),
        (
            prioritized(
                &(0..9)
                    .map(|i| sub(&format!("s{i}"), "plain"))
                    .collect::<Vec<_>>(),
            ),
            "spec.devices.requests[0].firstAvailable: 9 subrequests; a prioritized list holds 1 to 8",
        ),
        (
            json!([{ "name": "gpu", "exactly": { "deviceClassName": "plain" },
                     "firstAvailable": [sub("a", "plain")] }]),
            "spec.devices.requests[0].firstAvailable: set either exactly or firstAvailable",
        ),
        (
            json!([{ "name": "gpu", "firstAvailable": [
                { "name": "a", "deviceClassName": "plain", "tolerations": [{ "key": "k", "effect": "Sometimes" }] },
            ] }]),
            "spec.devices.requests[0].firstAvailable[0].tolerations[0].effect: \"Sometimes\" is not a taint effect",
        ),
    ];
    for (requests, message) in cases {
        let err = error_of(&requests, &json!([]));
        assert!(err.starts_with(message), "{err}\n  expected {message}");
    }
}

#[test]
fn tolerations_and_admin_access_reach_the_allocator() {
    let requests = json!([
        { "name": "gpu", "exactly": { "deviceClassName": "plain", "tolerations": [
            { "key": "gpu.kerf.dev/unhealthy", "operator": "Exists", "effect": "NoSchedule" },
            { "key": "k", "value": "v" },
        ] } },
        { "name": "monitor", "exactly": { "deviceClassName": "plain", "adminAccess": true, "count": 2 } },
    ]);
    let claim = request_of(&requests, &json!([])).unwrap();
    assert_eq!(
        claim.requests[0].tolerations,
        [
            alloc::Toleration {
                key: "gpu.kerf.dev/unhealthy".into(),
                operator: alloc::TolerationOperator::Exists,
                value: String::new(),
                effect: Some(alloc::TaintEffect::NoSchedule),
            },
            alloc::Toleration {
                key: "k".into(),
                operator: alloc::TolerationOperator::Equal,
                value: "v".into(),
                effect: None,
            },
        ]
    );
    assert!(!claim.requests[0].admin_access);
    assert!(claim.requests[1].admin_access);
    assert_eq!(claim.requests[1].count, 2);
}

#[test]
fn admin_access_with_a_slice_is_refused_with_the_field() {
    let requests = json!([
        { "name": "monitor", "exactly": { "deviceClassName": "plain", "adminAccess": true } },
    ]);
    let err = error_of(
        &requests,
        &json!([config(&[], &json!({ "memory": "10Gi" }))]),
    );
    assert!(
        err.starts_with("spec.devices.requests[0].exactly.adminAccess: true takes whole GPUs"),
        "{err}"
    );
}

#[test]
fn allocation_results_carry_tolerations_and_admin_access() {
    let toleration = json!({ "key": "gpu.kerf.dev/unhealthy", "operator": "Exists" });
    let claim = spec_claim(
        &json!([
            { "name": "gpu", "firstAvailable": [
                { "name": "big", "deviceClassName": "plain" },
                { "name": "small", "deviceClassName": "plain", "tolerations": [toleration] },
            ] },
            { "name": "monitor", "exactly": { "deviceClassName": "plain", "adminAccess": true } },
        ]),
        &json!([]),
    );
    let placed = ClaimPlacement {
        key: "uid-1".into(),
        devices: vec![
            placed("gpu/small", "gpu-0", None),
            placed("monitor", "gpu-1", None),
        ],
    };
    let allocation = claim_allocation_status(&claim, &placed, "node-1", DRIVER, time()).unwrap();
    let devices = allocation.devices.unwrap();
    let results = devices.results.unwrap();
    assert_eq!(results[0].request, "gpu/small");
    let tolerations = results[0].tolerations.as_ref().unwrap();
    assert_eq!(
        tolerations[0].key.as_deref(),
        Some("gpu.kerf.dev/unhealthy")
    );
    assert_eq!(results[0].admin_access, None);
    assert_eq!(results[1].admin_access, Some(true));
    assert_eq!(results[1].tolerations, None);
    // The slice config names `gpu/small`, which the plugin matches (claim::parent_request).
    let requests = devices.config.unwrap()[0].requests.clone().unwrap();
    assert_eq!(requests, ["gpu/small", "monitor"]);
}
