#![allow(clippy::unwrap_used, clippy::panic)]

use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use kerf_core::rng::SeededRng;
use kube::core::Status;
use tokio::sync::watch;

use super::*;

const DRIVER: &str = "gpu.kerf.dev";
const NODE: &str = "node-a";
const FRESH: &str = "uid-new";

fn claim(uid: &str, pool: Option<&str>, device: &str) -> ResourceClaim {
    let status = pool.map_or_else(
        || serde_json::json!({}),
        |pool| {
            serde_json::json!({"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": pool, "device": device},
            ]}}})
        },
    );
    serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": "ns", "name": "c", "uid": uid},
        "spec": {},
        "status": status,
    }))
    .unwrap()
}

fn fresh() -> ResourceClaim {
    claim(FRESH, Some(NODE), "gpu-1")
}

fn wanted(uid: &str) -> Wanted {
    Wanted {
        namespace: "ns".into(),
        name: "c".into(),
        uid: uid.into(),
        driver: DRIVER.into(),
        node: NODE.into(),
    }
}

fn not_found() -> kube::Error {
    kube::Error::Api(
        Status::failure("not found", "NotFound")
            .with_code(404)
            .boxed(),
    )
}

/// One scripted answer of a read: after `delay`, the claim, or 404 when `None`.
#[derive(Clone)]
struct Script {
    delay: Duration,
    answer: Option<ResourceClaim>,
}

impl Script {
    fn now(answer: Option<ResourceClaim>) -> Self {
        Script {
            delay: Duration::ZERO,
            answer,
        }
    }

    async fn play(&self) -> Result<ResourceClaim, kube::Error> {
        tokio::time::sleep(self.delay).await;
        self.answer.clone().ok_or_else(not_found)
    }
}

/// A reader whose cache, watch and reads follow a script: `any` is the `resourceVersion=0`
/// answer (`None`: the reader does not allow that read), `quorum` the GET's; the watch
/// delivers what [`Scripted::deliver`] sends.
struct Scripted {
    cached: Cached,
    any: Option<Script>,
    quorum: Script,
    delivered: watch::Sender<Option<Arc<ResourceClaim>>>,
    calls: Mutex<Vec<&'static str>>,
}

impl Scripted {
    fn new(cached: Cached, any: Option<Script>, quorum: Script) -> Arc<Self> {
        Arc::new(Scripted {
            cached,
            any,
            quorum,
            delivered: watch::Sender::new(None),
            calls: Mutex::default(),
        })
    }

    fn deliver(&self, claim: ResourceClaim) {
        self.delivered.send_replace(Some(Arc::new(claim)));
    }

    fn calls(&self) -> Vec<&'static str> {
        self.calls.lock().unwrap().clone()
    }

    fn call(&self, what: &'static str) {
        self.calls.lock().unwrap().push(what);
    }
}

impl ClaimReader for Scripted {
    fn get<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        self.call("get");
        Box::pin(self.quorum.play())
    }

    fn get_any<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim, kube::Error>> {
        self.call("get_any");
        Box::pin(async move { self.any.as_ref().unwrap().play().await })
    }

    fn may_read_any(&self, _: &str) -> bool {
        self.any.is_some()
    }

    fn until_cached<'a>(&'a self, wanted: &'a Wanted) -> BoxFuture<'a, Arc<ResourceClaim>> {
        let mut delivered = self.delivered.subscribe();
        Box::pin(async move {
            loop {
                let copy = delivered.borrow_and_update().clone();
                if let Some(claim) = copy
                    && let Ok(claim) = wanted.usable(Cached::Found(claim))
                {
                    return claim;
                }
                if delivered.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
    }

    fn cached(&self, _: &str, _: &str) -> Cached {
        self.cached.clone()
    }
}

async fn read_as(reader: &Arc<Scripted>, uid: &str) -> Result<(String, Lookup), ReadError> {
    let reader: Arc<dyn ClaimReader> = Arc::clone(reader) as Arc<dyn ClaimReader>;
    let (claim, lookup) = read(&reader, &wanted(uid)).await?;
    Ok((claim.metadata.uid.clone().unwrap(), lookup))
}

#[tokio::test]
async fn a_usable_cached_copy_makes_no_request() {
    let reader = Scripted::new(
        Cached::Found(Arc::new(fresh())),
        Some(Script::now(None)),
        Script::now(None),
    );
    let (uid, lookup) = read_as(&reader, FRESH).await.unwrap();
    assert_eq!((uid.as_str(), lookup), (FRESH, Lookup::Cache));
    assert!(reader.calls().is_empty(), "{:?}", reader.calls());
}

#[tokio::test]
async fn a_usable_any_answer_needs_no_quorum_get() {
    let reader = Scripted::new(
        Cached::Absent,
        Some(Script::now(Some(fresh()))),
        Script::now(None),
    );
    let (uid, lookup) = read_as(&reader, FRESH).await.unwrap();
    assert_eq!(
        (uid.as_str(), lookup),
        (FRESH, Lookup::ApiAny(Fallback::Miss))
    );
    assert_eq!(reader.calls(), ["get_any"]);
}

#[tokio::test]
async fn a_stale_any_answer_goes_on_to_the_quorum_get() {
    for stale in [
        Some(claim(FRESH, None, "")),
        Some(claim("uid-old", Some(NODE), "gpu-0")),
        Some(claim(FRESH, Some("node-b"), "gpu-0")),
        None,
    ] {
        let reader = Scripted::new(
            Cached::Absent,
            Some(Script::now(stale.clone())),
            Script::now(Some(fresh())),
        );
        let (uid, lookup) = read_as(&reader, FRESH).await.unwrap();
        assert_eq!(
            (uid.as_str(), lookup),
            (FRESH, Lookup::Api(Fallback::Miss)),
            "{stale:?}"
        );
        assert_eq!(reader.calls(), ["get_any", "get"]);
    }
}

#[tokio::test]
async fn a_reader_that_forbids_the_any_read_makes_only_the_quorum_get() {
    let reader = Scripted::new(Cached::HeldBack, None, Script::now(Some(fresh())));
    let (_, lookup) = read_as(&reader, FRESH).await.unwrap();
    assert_eq!(lookup, Lookup::Api(Fallback::Unprepared));
    assert_eq!(reader.calls(), ["get"]);
}

#[tokio::test]
async fn the_watch_wins_when_it_delivers_before_the_get_answers() {
    let slow = Script {
        delay: Duration::from_secs(3600),
        answer: Some(fresh()),
    };
    let reader = Scripted::new(Cached::Absent, Some(slow.clone()), slow);
    let delivering = Arc::clone(&reader);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(5)).await;
        // First a copy that must not be taken (the label before the allocation), then one.
        delivering.deliver(claim(FRESH, None, ""));
        tokio::time::sleep(Duration::from_millis(5)).await;
        delivering.deliver(fresh());
    });
    let (uid, lookup) = read_as(&reader, FRESH).await.unwrap();
    assert_eq!(
        (uid.as_str(), lookup),
        (FRESH, Lookup::Watch(Fallback::Miss))
    );
}

#[tokio::test]
async fn the_get_wins_when_the_watch_never_delivers_a_usable_copy() {
    let reader = Scripted::new(
        Cached::NotSynced,
        Some(Script::now(None)),
        Script::now(Some(fresh())),
    );
    reader.deliver(claim(FRESH, Some("node-b"), "gpu-0"));
    let (_, lookup) = read_as(&reader, FRESH).await.unwrap();
    assert_eq!(lookup, Lookup::Api(Fallback::NotSynced));
}

#[tokio::test]
async fn a_claim_recreated_under_its_name_is_read_by_its_uid() {
    // The cache and the watch cache still hold the old claim; the kubelet names the new one.
    let old = claim("uid-old", Some(NODE), "gpu-0");
    let reader = Scripted::new(
        Cached::Found(Arc::new(old.clone())),
        Some(Script::now(Some(old.clone()))),
        Script::now(Some(fresh())),
    );
    let (uid, lookup) = read_as(&reader, FRESH).await.unwrap();
    assert_eq!(
        (uid.as_str(), lookup),
        (FRESH, Lookup::Api(Fallback::UidMismatch))
    );
    // The kubelet names the old one: the quorum GET's answer (the new UID) goes to the
    // preparer, which refuses it.
    let reader = Scripted::new(
        Cached::Found(Arc::new(fresh())),
        Some(Script::now(Some(fresh()))),
        Script::now(Some(fresh())),
    );
    let (uid, lookup) = read_as(&reader, "uid-old").await.unwrap();
    assert_eq!(
        (uid.as_str(), lookup),
        (FRESH, Lookup::Api(Fallback::UidMismatch))
    );
}

#[tokio::test]
async fn a_failed_quorum_get_is_the_error_with_its_lookup() {
    let reader = Scripted::new(Cached::Absent, Some(Script::now(None)), Script::now(None));
    let error = read_as(&reader, FRESH).await.unwrap_err();
    assert!(
        matches!(&error, ReadError::Api { error: kube::Error::Api(s), .. } if s.code == 404),
        "{error:?}"
    );
    assert_eq!(error.lookup(), Lookup::Api(Fallback::Miss));
}

/// The race's random choices: a seeded sequence, so that a failing seed can be run again.
struct Rng(SeededRng);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0.next_u64() % n
    }

    fn delay(&mut self) -> Duration {
        Duration::from_micros(self.below(3000))
    }

    /// A copy the API server's watch cache or this plugin's watch may still hold when the
    /// current claim is [`fresh`]: none yet, the label before the allocation, the claim of
    /// the same name before it was deleted and created again, an allocation on another node
    /// (cleared meanwhile); or the current one.
    fn copy(&mut self) -> Option<ResourceClaim> {
        match self.below(5) {
            0 => None,
            1 => Some(claim(FRESH, None, "")),
            2 => Some(claim("uid-old", Some(NODE), "gpu-0")),
            3 => Some(claim(FRESH, Some("node-b"), "gpu-0")),
            _ => Some(fresh()),
        }
    }
}

fn device_of(claim: &ResourceClaim) -> (&str, &str) {
    let result = &claim
        .status
        .as_ref()
        .unwrap()
        .allocation
        .as_ref()
        .unwrap()
        .devices
        .as_ref()
        .unwrap()
        .results
        .as_ref()
        .unwrap()[0];
    (result.pool.as_str(), result.device.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_interleavings_of_watch_and_reads_only_ever_yield_the_current_allocation() {
    for seed in [1_u64, 7, 42, 2026, 31337] {
        println!("seed {seed}");
        let mut rng = Rng(SeededRng::new(seed));
        for round in 0..40 {
            let cached = match rng.below(4) {
                0 => Cached::Absent,
                1 => Cached::NotSynced,
                2 => Cached::HeldBack,
                _ => rng
                    .copy()
                    .map_or(Cached::Absent, |c| Cached::Found(Arc::new(c))),
            };
            // A claim held back is never read with resourceVersion=0.
            let any = (!matches!(cached, Cached::HeldBack)).then(|| Script {
                delay: rng.delay(),
                answer: rng.copy(),
            });
            let quorum = Script {
                delay: rng.delay(),
                answer: Some(fresh()),
            };
            let reader = Scripted::new(cached, any, quorum);
            let deliveries: Vec<(Duration, Option<ResourceClaim>)> = (0..rng.below(3))
                .map(|_| (rng.delay(), rng.copy()))
                .collect();
            let delivering = Arc::clone(&reader);
            let watch = tokio::spawn(async move {
                for (delay, copy) in deliveries {
                    tokio::time::sleep(delay).await;
                    if let Some(copy) = copy {
                        delivering.deliver(copy);
                    }
                }
            });
            let dyn_reader: Arc<dyn ClaimReader> = Arc::clone(&reader) as Arc<dyn ClaimReader>;
            let (claim, lookup) = read(&dyn_reader, &wanted(FRESH))
                .await
                .unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}"));
            assert_eq!(
                claim.metadata.uid.as_deref(),
                Some(FRESH),
                "seed {seed} round {round}: {lookup:?}"
            );
            assert_eq!(
                device_of(&claim),
                (NODE, "gpu-1"),
                "seed {seed} round {round}: {lookup:?}"
            );
            watch.abort();
        }
    }
}
