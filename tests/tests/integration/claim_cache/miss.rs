//! The miss path: a prepare the cache cannot answer at once races the API read against the
//! watch. GETs the test holds for an hour can only lose, so which side wins is decided by the
//! test, not by the clock; the seeded test mixes the orders at random.

use kerf_scheduler_standin::SeededRng;

use super::*;

/// Longer than any test: a GET held this long never answers first.
const HOLD: Duration = Duration::from_secs(3600);

/// Starts a prepare of `claim` that runs beside the test.
fn spawn_prepare(
    node: &CacheNode,
    claim: ClaimRef,
) -> tokio::task::JoinHandle<kerf_kubelet_plugin::Result<Vec<PreparedDevice>>> {
    let preparer = Arc::clone(node.running().preparer());
    tokio::spawn(async move {
        preparer
            .prepare(std::slice::from_ref(&claim))
            .await
            .pop()
            .unwrap()
            .1
    })
}

/// Waits until the API server has received a GET of `name` (which it may hold).
async fn until_read(node: &CacheNode, name: &str) {
    until("the prepare's GET", WAIT, || node.gets(name) > 0).await;
}

#[tokio::test]
async fn a_label_that_lands_while_the_get_is_held_prepares_from_the_watch() {
    let node = CacheNode::start(true).await;
    let id = uid(60);
    // Allocated by kube-scheduler; kerf-controller's label has not landed.
    node.node
        .api
        .insert(claim("late", &id, false, here("gpu-2")));
    node.node
        .api
        .delay_next("get", &fixtures::claim_path(NAMESPACE, "late"), HOLD, 2);
    let prepare = spawn_prepare(&node, claim_ref("late", &id));
    until_read(&node, "late").await;

    node.node
        .api
        .insert(claim("late", &id, true, here("gpu-2")));

    let devices = prepare.await.unwrap().unwrap();
    assert_eq!(devices[0].device_name, "gpu-2");
    assert!(devices[0].cdi_device_ids[0].contains(&id), "{devices:?}");
    assert_eq!(node.lookups("watch", "miss"), 1);
    node.stop().await;
}

#[tokio::test]
async fn an_allocation_the_watch_delivers_before_the_get_answers_is_prepared() {
    let node = CacheNode::start(true).await;
    let id = uid(61);
    // kerf-controller's own claim: labelled in the write that marks it, allocated later.
    node.node.api.insert(claim("early", &id, true, None));
    node.until_cached("early", "the unallocated claim", |c| {
        matches!(c, Cached::Found(_))
    })
    .await;
    node.node
        .api
        .delay_next("get", &fixtures::claim_path(NAMESPACE, "early"), HOLD, 2);
    let prepare = spawn_prepare(&node, claim_ref("early", &id));
    until_read(&node, "early").await;

    node.node
        .api
        .insert(claim("early", &id, true, here("gpu-3")));

    let devices = prepare.await.unwrap().unwrap();
    assert_eq!(devices[0].device_name, "gpu-3");
    assert_eq!(node.lookups("watch", "not_allocated_here"), 1);
    node.stop().await;
}

#[tokio::test]
async fn the_get_that_answers_while_the_watch_is_held_back_prepares() {
    let node = CacheNode::start(true).await;
    let id = uid(62);
    node.node.api.insert(claim("held", &id, true, None));
    node.until_cached("held", "the unallocated claim", |c| {
        matches!(c, Cached::Found(_))
    })
    .await;
    freeze_cache(&node);
    node.node
        .api
        .insert(claim("held", &id, true, here("gpu-1")));

    let devices = node.prepare(&claim_ref("held", &id)).await.unwrap();

    assert_eq!(devices[0].device_name, "gpu-1");
    assert_eq!(node.lookups("api_any", "not_allocated_here"), 1);
    assert_eq!((node.gets("held"), node.any_gets("held")), (1, 1));
    node.stop().await;
}

#[tokio::test]
async fn a_claim_recreated_under_its_name_is_prepared_from_the_watch_by_its_new_uid() {
    let node = CacheNode::start(true).await;
    let (old, new) = (uid(63), uid(64));
    node.node
        .api
        .insert(claim("again", &old, true, here("gpu-0")));
    node.until_cached("again", "the old claim", |c| matches!(c, Cached::Found(_)))
        .await;
    // The kubelet names the new claim while the cache still holds the old one, and the GET is
    // held: only the watch can answer, and only with the new UID.
    node.node
        .api
        .delay_next("get", &fixtures::claim_path(NAMESPACE, "again"), HOLD, 2);
    let prepare = spawn_prepare(&node, claim_ref("again", &new));
    until_read(&node, "again").await;
    node.node
        .api
        .remove(&fixtures::claim_path(NAMESPACE, "again"));
    node.node
        .api
        .insert(claim("again", &new, true, here("gpu-1")));

    let devices = prepare.await.unwrap().unwrap();

    assert_eq!(devices[0].device_name, "gpu-1");
    assert!(devices[0].cdi_device_ids[0].contains(&new), "{devices:?}");
    assert_eq!(node.lookups("watch", "uid_mismatch"), 1);
    node.stop().await;
}

/// How the claim of one round reaches the API server and the watch.
#[derive(Debug, Clone, Copy)]
enum Arrival {
    /// Allocated unlabelled; the label lands after the prepare started.
    LabelLate,
    /// Labelled and cached unallocated; the allocation reaches the API server at once and the
    /// watch later.
    AllocationLate,
    /// The cache holds an older claim of the name; the new one reaches the watch later.
    Recreated,
}

/// A random delay of 0-20 ms.
fn jitter(rng: &mut SeededRng) -> Duration {
    Duration::from_millis(u64::try_from(rng.below(21)).unwrap())
}

async fn miss_round(node: &CacheNode, rng: &mut SeededRng, seed: u64, round: u32) {
    let name = format!("m{seed}r{round}x");
    let id = uid(u32::try_from(seed % 1000).unwrap() * 1000 + round);
    let device = format!("gpu-{}", rng.below(8));
    let arrival = match rng.below(3) {
        0 => Arrival::LabelLate,
        1 => Arrival::AllocationLate,
        _ => Arrival::Recreated,
    };
    let (watch_lag, get_lag) = (jitter(rng), jitter(rng));
    let context =
        format!("seed {seed} round {round}: {arrival:?}, watch {watch_lag:?}, GET {get_lag:?}");
    match arrival {
        Arrival::LabelLate => node
            .node
            .api
            .insert(claim(&name, &id, false, here(&device))),
        Arrival::AllocationLate | Arrival::Recreated => {
            let first = if matches!(arrival, Arrival::Recreated) {
                claim(&name, &uid(900_000 + round), true, here("gpu-7"))
            } else {
                claim(&name, &id, true, None)
            };
            node.node.api.insert(first);
            node.until_cached(&name, "the first copy", |c| matches!(c, Cached::Found(_)))
                .await;
            node.node.api.delay_next(
                "watch",
                "/apis/resource.k8s.io/v1/resourceclaims",
                watch_lag,
                1,
            );
            node.node.api.close_watches();
            if matches!(arrival, Arrival::Recreated) {
                node.node
                    .api
                    .remove(&fixtures::claim_path(NAMESPACE, &name));
            }
            node.node.api.insert(claim(&name, &id, true, here(&device)))
        }
    };
    node.node
        .api
        .delay_next("get", &fixtures::claim_path(NAMESPACE, &name), get_lag, 2);
    let prepare = spawn_prepare(node, claim_ref(&name, &id));
    if matches!(arrival, Arrival::LabelLate) {
        tokio::time::sleep(watch_lag).await;
        node.node.api.insert(claim(&name, &id, true, here(&device)));
    }
    let devices = prepare
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{context}: {e}"));
    assert_eq!(devices.len(), 1, "{context}: {devices:?}");
    assert_eq!(devices[0].device_name, device, "{context}");
    assert_eq!(devices[0].pool_name, NODE, "{context}");
    assert!(
        devices[0].cdi_device_ids[0].contains(&id),
        "{context}: {devices:?}"
    );
    node.unprepare(&claim_ref(&name, &id)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_orders_of_watch_and_get_prepare_the_current_allocation() {
    for seed in [3_u64, 11, 99, 2027] {
        println!("seed {seed}");
        let node = CacheNode::start(true).await;
        let mut rng = SeededRng::new(seed);
        for round in 0..12 {
            miss_round(&node, &mut rng, seed, round).await;
        }
        let read = |source| {
            ["miss", "not_allocated_here", "uid_mismatch"]
                .iter()
                .map(|reason| node.lookups(source, reason))
                .sum::<u64>()
        };
        println!(
            "seed {seed}: from the watch {}, resourceVersion=0 {}, quorum {}",
            read("watch"),
            read("api_any"),
            read("api")
        );
        node.stop().await;
    }
}
