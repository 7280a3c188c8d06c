//! `spec.extendedResourceName`: written into the DeviceClass of Scheduler classes, refused with
//! a condition for Controller classes, left out with one log line and no write loop where the
//! API server drops the field, and invalid names reported naming the field.

use kerf_api::features::PROBE_NAME_PREFIX;
use kerf_api::gpuclass::CONDITION_EXTENDED_RESOURCE;
use kerf_controller::extended_resource::reasons;
use kerf_tests::logs::CapturedLogs;

use super::*;

const NAME: &str = "gpu.kerf.dev/gpu";

fn named(allocator: Allocator, name: &str) -> GpuClassSpec {
    GpuClassSpec {
        allocator,
        extended_resource_name: Some(name.to_owned()),
        slicing: (allocator == Allocator::Controller).then(kerf_api::Slicing::default),
        ..GpuClassSpec::default()
    }
}

/// The ExtendedResource condition's status, reason and message.
fn extended(class: &GpuClass) -> Option<(String, String, String)> {
    let condition = class
        .status
        .as_ref()?
        .condition(CONDITION_EXTENDED_RESOURCE)?;
    Some((
        condition.status.clone(),
        condition.reason.clone(),
        condition.message.clone(),
    ))
}

#[tokio::test]
async fn a_scheduler_class_names_its_device_class_and_can_take_the_name_back() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "l4", 1);
    gpu_class(&fake, "whole", named(Allocator::Scheduler, NAME));
    let h = Harness::new(&fake).await;
    h.reconcile("whole").await.unwrap();

    let dc = h.device_class("whole").unwrap();
    assert_eq!(dc.spec.extended_resource_name.as_deref(), Some(NAME));
    let (status, reason, message) = extended(&h.class("whole")).unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", reasons::NAME_APPLIED)
    );
    assert!(message.contains(NAME), "{message}");
    assert_eq!(ready(&h.class("whole")).0, "True");

    // The admin drops the name: server-side apply removes it, and the condition goes.
    let mut class = h.class("whole");
    class.spec.extended_resource_name = None;
    fake.insert_resource(&class);
    eventually("the DeviceClass in the cache", DEADLINE, || async {
        h.ctx
            .caches
            .device_classes
            .get(&ObjectRef::new("whole"))
            .map(|_| ())
    })
    .await;
    h.reconcile("whole").await.unwrap();
    assert_eq!(
        h.device_class("whole").unwrap().spec.extended_resource_name,
        None
    );
    assert_eq!(extended(&h.class("whole")), None);
}

#[tokio::test]
async fn a_controller_class_gets_the_condition_and_no_name() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "h100-sxm-80gb:1", 1);
    gpu_class(
        &fake,
        "slices",
        named(Allocator::Controller, "gpu.kerf.dev/slice-10gi"),
    );
    let h = Harness::new(&fake).await;
    h.reconcile("slices").await.unwrap();

    let dc = h
        .device_class("slices")
        .expect("the DeviceClass exists anyway");
    assert_eq!(dc.spec.extended_resource_name, None);
    let (status, reason, message) = extended(&h.class("slices")).unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", reasons::UNSUPPORTED_FOR_CONTROLLER_CLASS)
    );
    assert!(message.contains("gpu.kerf.dev/slice-10gi"), "{message}");
    assert_eq!(ready(&h.class("slices")).0, "True", "claims still work");
    let events = eventually("a Warning event", DEADLINE, || async {
        let events = fake.list("/apis/events.k8s.io/v1/events");
        events
            .iter()
            .any(|e| e["reason"] == reasons::UNSUPPORTED_FOR_CONTROLLER_CLASS)
            .then_some(events)
    })
    .await;
    assert!(events.iter().all(|e| e["regarding"]["name"] == "slices"));
}

#[tokio::test]
async fn an_invalid_name_is_reported_naming_the_field() {
    let fake = FakeApi::new();
    gpu_class(
        &fake,
        "bad",
        named(Allocator::Scheduler, "kubernetes.io/gpu"),
    );
    let h = Harness::new(&fake).await;
    let action = h.reconcile("bad").await.unwrap();
    assert_eq!(action, Action::await_change());
    let (status, reason, message) = ready(&h.class("bad"));
    assert_eq!((status.as_str(), reason.as_str()), ("False", "InvalidSpec"));
    assert!(
        message.contains("spec.extendedResourceName") && message.contains("\"kubernetes.io/gpu\""),
        "{message}"
    );
    assert!(h.device_class("bad").is_none());
}

#[tokio::test]
async fn a_name_another_device_class_holds_is_reported() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "l4", 1);
    gpu_class(&fake, "whole", named(Allocator::Scheduler, NAME));
    let h = Harness::new(&fake).await;
    h.reconcile("whole").await.unwrap();
    // Created after kerf's class (or in the same second, with a name that sorts first):
    // kube-scheduler picks it.
    fake.insert(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "aaa-device-plugin-successor"},
        "spec": {"extendedResourceName": NAME, "selectors": [{"cel": {"expression": "true"}}]},
    }));
    eventually("the other DeviceClass in the cache", DEADLINE, || async {
        (h.ctx.caches.device_classes.len() == 2).then_some(())
    })
    .await;
    h.reconcile("whole").await.unwrap();
    let (status, reason, message) = extended(&h.class("whole")).unwrap();
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", reasons::NAME_TAKEN)
    );
    assert!(
        message.contains("DeviceClass aaa-device-plugin-successor"),
        "{message}"
    );
    assert_eq!(
        h.device_class("whole")
            .unwrap()
            .spec
            .extended_resource_name
            .as_deref(),
        Some(NAME),
        "the name stays: writing it does not depend on other classes, so nothing flaps"
    );
}

/// The whole process against an API server whose DRAExtendedResource gate is off.
#[tokio::test]
async fn a_server_that_drops_the_field_gets_one_probe_one_log_line_and_no_loop() {
    let logs = CapturedLogs::default();
    let _guard = logs.capture(tracing::Level::INFO);
    let fake = FakeApi::new();
    fake.drop_field("deviceclasses", "spec.extendedResourceName");
    seed_node(&fake, "node-a", "l4", 1);
    gpu_class(&fake, "whole", named(Allocator::Scheduler, NAME));
    let running = RunningController::start(&fake);

    let (_, _, message) = eventually("the NotServed condition", DEADLINE, || async {
        let class: GpuClass = fake.get_resource(None, "whole")?;
        extended(&class).filter(|(_, reason, _)| reason == reasons::NOT_SERVED_BY_API_SERVER)
    })
    .await;
    assert!(message.contains("DRAExtendedResource"), "{message}");
    let dc: DeviceClass = fake.get_resource(None, "whole").unwrap();
    assert_eq!(dc.spec.extended_resource_name, None);

    // More cache changes and a second class: each re-evaluates "whole", which must cost no
    // further write.
    seed_node(&fake, "node-b", "l4", 1);
    allocated_claim(&fake, "c", json!([result("node-a", "gpu-0")]), json!([]));
    gpu_class(&fake, "later", GpuClassSpec::default());
    eventually(
        "the later class's status with the new node",
        DEADLINE,
        || async {
            let class: GpuClass = fake.get_resource(None, "later")?;
            (class.status?.matching_devices == Some(4)).then_some(())
        },
    )
    .await;
    eventually(
        "the whole class's status with the new node",
        DEADLINE,
        || async {
            let class: GpuClass = fake.get_resource(None, "whole")?;
            let free = class.status?.free_memory?;
            (parse_bytes(&free.0).ok()? == 3 * L4_BYTES).then_some(())
        },
    )
    .await;

    let probes = fake
        .requests()
        .into_iter()
        .filter(|r| r.matches("create", DEVICE_CLASSES) && r.query.contains("dryRun=All"))
        .count();
    // One dry-run DeviceClass per probed feature and term: extendedResourceName and
    // consumable capacity (`device.allowMultipleAllocations` in a selector).
    assert_eq!(probes, 2, "one probe per feature and term");
    assert_eq!(fake.count("patch", &format!("{DEVICE_CLASSES}/whole")), 1);
    // Status writes: the first, then the free memory after the node and the claim.
    let status_writes = fake.count("patch", &format!("{GPU_CLASSES}/whole/status"));
    assert!(status_writes <= 4, "{status_writes} status writes");
    let degraded = logs.lines_containing("DRAExtendedResource");
    assert_eq!(degraded.len(), 1, "{degraded:?}");
    assert!(
        degraded[0].contains("DeviceClass spec.extendedResourceName"),
        "{degraded:?}"
    );
    assert!(
        fake.list(DEVICE_CLASSES)
            .iter()
            .all(|dc| !dc["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .starts_with(PROBE_NAME_PREFIX)),
        "the dry-run probe stores nothing"
    );

    running.stop().await;
}

/// A served field: the probe says so and the running controller writes the name.
#[tokio::test]
async fn a_server_that_keeps_the_field_gets_the_name_written() {
    let fake = FakeApi::new();
    seed_node(&fake, "node-a", "l4", 1);
    gpu_class(&fake, "whole", named(Allocator::Scheduler, NAME));
    let running = RunningController::start(&fake);
    eventually("the named DeviceClass", DEADLINE, || async {
        fake.get_resource::<DeviceClass>(None, "whole")?
            .spec
            .extended_resource_name
            .filter(|n| n == NAME)
    })
    .await;
    let probe = fake
        .requests()
        .into_iter()
        .find(|r| r.matches("create", DEVICE_CLASSES))
        .unwrap();
    assert!(
        probe.query.contains("dryRun=All") && probe.query.contains("fieldManager=kerf-controller"),
        "{}",
        probe.query
    );
    running.stop().await;
}
