use super::*;
use kube::runtime::reflector;
use serde_json::json;

const DRIVER: &str = "gpu.kerf.dev";

fn pod(uid: &str, created: i64) -> Pod {
    serde_json::from_value(json!({
        "metadata": {
            "name": "p", "namespace": "ns", "uid": uid,
            "creationTimestamp": Timestamp::from_second(created).unwrap().to_string(),
        },
        "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}]},
    }))
    .unwrap()
}

fn claim(allocated_by: Option<&str>) -> ResourceClaim {
    let mut claim = json!({"metadata": {"name": "c", "namespace": "ns"}, "spec": {}});
    if let Some(driver) = allocated_by {
        claim["status"] = json!({"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": driver, "pool": "n1", "device": "gpu-0"}
        ]}}});
    }
    serde_json::from_value(claim).unwrap()
}

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).unwrap()
}

#[test]
fn a_pod_seen_waiting_is_observed_once_its_claims_are_allocated() {
    let (claims, mut writer) = reflector::store();
    let latency = PodLatency::default();
    let waiting = pod("u1", 100);
    writer.apply_watcher_event(&watcher::Event::Apply(claim(None)));
    let event = watcher::Event::Apply(waiting.clone());
    assert_eq!(
        latency.apply_pod_event(&event, &claims, DRIVER, at(101)),
        None
    );

    let allocated = claim(Some(DRIVER));
    writer.apply_watcher_event(&watcher::Event::Apply(allocated.clone()));
    let pods = [std::sync::Arc::new(waiting.clone())];
    let observed = latency.claim_changed(&allocated, pods.clone(), &claims, DRIVER, at(103));
    assert_eq!(observed, [Duration::from_secs(3)]);
    // Once only: the pod is no longer waiting.
    assert!(
        latency
            .claim_changed(&allocated, pods, &claims, DRIVER, at(104))
            .is_empty()
    );
    assert_eq!(
        latency.apply_pod_event(&event, &claims, DRIVER, at(105)),
        None
    );
}

#[test]
fn pods_allocated_before_they_were_seen_or_by_another_driver_are_not_observed() {
    let (claims, mut writer) = reflector::store();
    let latency = PodLatency::default();
    writer.apply_watcher_event(&watcher::Event::Apply(claim(Some(DRIVER))));
    let event = watcher::Event::InitApply(pod("u1", 100));
    assert_eq!(
        latency.apply_pod_event(&event, &claims, DRIVER, at(500)),
        None
    );

    writer.apply_watcher_event(&watcher::Event::Apply(claim(None)));
    let event = watcher::Event::Apply(pod("u2", 200));
    assert_eq!(
        latency.apply_pod_event(&event, &claims, DRIVER, at(201)),
        None
    );
    writer.apply_watcher_event(&watcher::Event::Apply(claim(Some("other.example.com"))));
    assert_eq!(
        latency.apply_pod_event(&event, &claims, DRIVER, at(202)),
        None
    );
    assert!(latency.lock().is_empty());
}

#[test]
fn a_deleted_pod_is_forgotten() {
    let (claims, mut writer) = reflector::store();
    let latency = PodLatency::default();
    writer.apply_watcher_event(&watcher::Event::Apply(claim(None)));
    let waiting = pod("u1", 100);
    latency.apply_pod_event(
        &watcher::Event::Apply(waiting.clone()),
        &claims,
        DRIVER,
        at(101),
    );
    assert_eq!(latency.lock().len(), 1);
    latency.apply_pod_event(&watcher::Event::Delete(waiting), &claims, DRIVER, at(102));
    assert!(latency.lock().is_empty());
}
