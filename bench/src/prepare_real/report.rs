//! The figures, shares and targets of `prepare-real`.

use std::time::Duration;

use super::disk_writer;
use super::{CacheUse, RealRuns};
use crate::prepare::ratio_of;
use crate::stats::{Samples, ms, percent, ratio, us};
use crate::summary::Summary;

/// The target for the cached path: its p99 within this factor of its floor's (the
/// empty call, one checkpoint write, the lookup).
const RATIO_P99_TARGET: f64 = 1.2;
/// The target for the miss path: its p99 within this factor of its floor's (one GET
/// and the cached path's floor).
const MISS_RATIO_P99_TARGET: f64 = 1.3;

/// What each part of a prepare costs at its median, measured on its own.
#[derive(Debug, Clone, Copy)]
struct PartMedians {
    api: Duration,
    checkpoint: Duration,
    plain: Duration,
    rpc: Duration,
}

/// Each part's share of a prepare's median, each between 0 and 1.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shares {
    /// The GETs the prepares made, per prepare, times a GET's median.
    api: f64,
    /// The checkpoint write, or the spec and metadata writes when they
    /// take longer: a prepare makes both at the same time.
    writes: f64,
    /// The empty `NodePrepareResources`: the socket, HTTP/2 and the gRPC layers both ways.
    grpc: f64,
    /// What is left: the plugin's own work, and anything not measured on its own.
    rest: f64,
}

impl Shares {
    fn of(prepare: Duration, gets_per_prepare: f64, parts: PartMedians) -> Self {
        let prepare = prepare.as_secs_f64().max(f64::MIN_POSITIVE);
        let share = |d: Duration| (d.as_secs_f64() / prepare).clamp(0.0, 1.0);
        let api = (gets_per_prepare * parts.api.as_secs_f64() / prepare).clamp(0.0, 1.0);
        let writes = share(parts.checkpoint.max(parts.plain));
        let grpc = share(parts.rpc);
        // The parts' medians need not add up to the prepare's; a negative rest means the
        // parts alone took longer than the whole, which says nothing about the plugin.
        let rest = (1.0 - api - writes - grpc).clamp(0.0, 1.0);
        Shares {
            api,
            writes,
            grpc,
            rest,
        }
    }

    fn line(&self) -> String {
        format!(
            "API {}%  writes {}%  gRPC {}%  rest {}%",
            percent(self.api),
            percent(self.writes),
            percent(self.grpc),
            percent(self.rest)
        )
    }

    fn figures(&self, s: &mut Summary, prefix: &str) {
        s.figure(&format!("{prefix}share_api"), format!("{:.3}", self.api))
            .figure(
                &format!("{prefix}share_writes"),
                format!("{:.3}", self.writes),
            )
            .figure(&format!("{prefix}share_grpc"), format!("{:.3}", self.grpc))
            .figure(&format!("{prefix}share_rest"), format!("{:.3}", self.rest));
    }
}

/// GETs per prepare, for the API share.
fn per_prepare(gets: usize, prepares: usize) -> f64 {
    // Both are counts of calls in one run, far below 2^52.
    #[allow(clippy::cast_precision_loss)]
    let per = gets as f64 / prepares.max(1) as f64;
    per
}

fn cache_line(runs: &RealRuns) -> String {
    let hits = runs.claims.saturating_sub(runs.cached_gets);
    match runs.cache {
        CacheUse::Hit => format!(
            "claim cache: the plugin watches its node's claims; {hits} of {} prepares of labelled claims came from it ({} GETs)",
            runs.claims, runs.cached_gets
        ),
        CacheUse::NotUsed => format!(
            "claim cache: NOT USED - the plugin never listed or watched ResourceClaims, so labelled claims were GET too ({} GETs for {} prepares); the \"from cache\" figures are a second GET series",
            runs.cached_gets, runs.claims
        ),
        CacheUse::NeverHit => format!(
            "claim cache: the plugin watches ResourceClaims but served no warm-up prepare without a GET within {} s ({} GETs for {} prepares)",
            super::CACHE_SYNC_TIMEOUT.as_secs(),
            runs.cached_gets,
            runs.claims
        ),
    }
}

/// The series of a run as samples.
struct Sampled {
    cached: Samples,
    cached_un: Samples,
    get: Samples,
    get_un: Samples,
    scheduler: Samples,
    controller: Samples,
    floor: Samples,
    miss_floor: Samples,
    api: Samples,
    checkpoint: Samples,
    no_dir_sync: Samples,
    plain: Samples,
    rpc: Samples,
    lookup: Samples,
}

impl Sampled {
    fn of(p: &super::PartRuns) -> Self {
        let sample = |v: &Vec<Duration>| Samples::new(v.clone());
        Sampled {
            cached: sample(&p.cached),
            cached_un: sample(&p.cached_unprepare),
            get: sample(&p.get),
            get_un: sample(&p.get_unprepare),
            scheduler: sample(&p.scheduler),
            controller: sample(&p.controller),
            floor: sample(&p.floor),
            miss_floor: Samples::new(p.miss_floor()),
            api: sample(&p.api),
            checkpoint: sample(&p.checkpoint_write),
            no_dir_sync: sample(&p.fsynced),
            plain: sample(&p.plain),
            rpc: sample(&p.rpc),
            lookup: sample(&p.lookup),
        }
    }
}

/// The summary of `prepare-real`: the run of every series on the plugin as deployed, and the
/// runs that take the cached path's p99 apart.
pub(super) fn summary(main: &RealRuns, tail: &[RealRuns]) -> Summary {
    let m = Sampled::of(&main.parts);
    let mut s = Summary::new("prepare-real");
    s.detail(format!(
        "{} claims of each series, one at a time over the plugin's Unix socket (mock H100, 10Gi MPS slice, accounting only); the plugin started as in production (plugin::start, Connections::kube) with a kube client read from a kubeconfig, against the in-memory API server over HTTP answering every request {} ms late; checkpoint and metadata files on {}, CDI specs on {}",
        main.claims,
        ms(main.api_latency),
        main.fs_type,
        main.cdi_fs_type
    ));
    s.detail(cache_line(main));
    cached_lines(&mut s, main, &m);
    miss_lines(&mut s, main, &m);
    parts_lines(&mut s, main, &m);
    figures(&mut s, main, &m);
    tail_lines(&mut s, &m, tail);
    targets(&mut s, main, &m);
    s
}

fn cached_lines(s: &mut Summary, runs: &RealRuns, m: &Sampled) {
    s.detail(format!(
        "from cache  prepare {}  unprepare {}",
        m.cached.p50_p99_max_ms(),
        m.cached_un.p50_p99_ms()
    ));
    s.detail(format!(
        "  floor     {}  (empty NodePrepareResources + 1 atomic write of {} bytes + 1 lookup among {} claims)  ratio_p50 {}  ratio_p99 {}",
        m.floor.p50_p99_max_ms(),
        runs.sizes.checkpoint,
        runs.cache_size,
        ratio(m.cached.p50(), m.floor.p50()),
        ratio(m.cached.p99(), m.floor.p99())
    ));
    s.detail(format!(
        "with GET    prepare {}  unprepare {}  (unlabelled claims allocated long before: {} GETs for {} prepares)  ratio_p99 to the miss floor {}",
        m.get.p50_p99_max_ms(),
        m.get_un.p50_p99_ms(),
        runs.get_gets,
        runs.claims,
        ratio(m.get.p99(), m.miss_floor.p99())
    ));
}

fn miss_lines(s: &mut Summary, runs: &RealRuns, m: &Sampled) {
    s.detail(format!(
        "miss path, prepared right after the allocation was written: kube-scheduler's (UpdateStatus, no node label) {}  ({} GETs for {} prepares)  ratio_p50 {}  ratio_p99 {};  kerf-controller's (status merge patch of a labelled claim) {}  ({} GETs)  ratio_p50 {}  ratio_p99 {}",
        m.scheduler.p50_p99_max_ms(),
        runs.scheduler_gets,
        runs.claims,
        ratio(m.scheduler.p50(), m.miss_floor.p50()),
        ratio(m.scheduler.p99(), m.miss_floor.p99()),
        m.controller.p50_p99_max_ms(),
        runs.controller_gets,
        ratio(m.controller.p50(), m.miss_floor.p50()),
        ratio(m.controller.p99(), m.miss_floor.p99()),
    ));
    s.detail(format!(
        "  miss floor {}  (a GET through the plugin's client + the floor above, measured in the same round)",
        m.miss_floor.p50_p99_max_ms()
    ));
}

fn parts_lines(s: &mut Summary, runs: &RealRuns, m: &Sampled) {
    let sizes = &runs.sizes;
    s.detail(format!(
        "parts, each on its own: GET of a claim {};  checkpoint write ({} B, atomic, no fsync) {};  the same fsync'd without the directory fsync (as dra-example-driver writes its checkpoint) {};  spec + {} metadata file(s) without fsync ({} B) {};  empty NodePrepareResources {};  map lookup p50 {} us",
        m.api.p50_p99_ms(),
        sizes.checkpoint,
        m.checkpoint.p50_p99_ms(),
        m.no_dir_sync.p50_p99_ms(),
        sizes.metadata.len(),
        sizes.plain_bytes(),
        m.plain.p50_p99_ms(),
        m.rpc.p50_p99_ms(),
        us(m.lookup.p50())
    ));
    let medians = PartMedians {
        api: m.api.p50(),
        checkpoint: m.checkpoint.p50(),
        plain: m.plain.p50(),
        rpc: m.rpc.p50(),
    };
    let cached = Shares::of(
        m.cached.p50(),
        per_prepare(runs.cached_gets, runs.claims),
        medians,
    );
    let get = Shares::of(
        m.get.p50(),
        per_prepare(runs.get_gets, runs.claims),
        medians,
    );
    let miss = Shares::of(
        m.scheduler.p50(),
        per_prepare(runs.scheduler_gets, runs.claims),
        medians,
    );
    s.detail(format!(
        "share of the prepare p50, from cache: {};  with GET: {};  miss (kube-scheduler's): {}  (API: GETs per prepare x a GET's p50; writes: the checkpoint write or the spec and metadata writes, whichever is longer, as a prepare makes them at the same time; gRPC: the empty call; rest: the plugin's own work and anything not measured on its own)",
        cached.line(),
        get.line(),
        miss.line()
    ));
    cached.figures(s, "");
    get.figures(s, "get_");
    miss.figures(s, "miss_");
}

/// The cached path's p99 in each tail run against the main run's, and what each difference
/// says: the status writer's share, the disk's share, what a busy disk adds.
fn tail_lines(s: &mut Summary, m: &Sampled, tail: &[RealRuns]) {
    let main_p99 = m.cached.p99();
    for runs in tail {
        let t = Sampled::of(&runs.parts);
        let name = runs.variant.name;
        let writer = runs.written.map_or(String::new(), |w| {
            format!(
                ";  disk writer: {} fsync'd records of {} B, {:.0}/s (a {} ms pause after each)",
                w.records,
                disk_writer::RECORD,
                w.per_second,
                disk_writer::PAUSE.as_millis()
            )
        });
        s.detail(format!(
            "tail run {name} (status writer {}, plugin files on {}): from cache {}  floor {}  ratio_p99 {}  checkpoint write {};  p99 {} ms against the main run's {} ms{writer}",
            if runs.variant.device_status { "on" } else { "off" },
            runs.fs_type,
            t.cached.p50_p99_ms(),
            t.floor.p50_p99_ms(),
            ratio(t.cached.p99(), t.floor.p99()),
            t.checkpoint.p50_p99_ms(),
            signed_ms(t.cached.p99(), main_p99),
            ms(main_p99),
        ));
        s.figure(&format!("{name}_p50_ms"), ms(t.cached.p50()))
            .figure(&format!("{name}_p99_ms"), ms(t.cached.p99()))
            .figure(&format!("{name}_floor_p99_ms"), ms(t.floor.p99()))
            .figure(
                &format!("{name}_ratio_p99"),
                ratio(t.cached.p99(), t.floor.p99()),
            )
            .figure(
                &format!("{name}_cache_hits"),
                runs.claims.saturating_sub(runs.cached_gets),
            );
        if let Some(w) = runs.written {
            s.figure(
                &format!("{name}_writes_per_s"),
                format!("{:.0}", w.per_second),
            );
        }
    }
}

/// `a - b` in milliseconds with its sign.
fn signed_ms(a: Duration, b: Duration) -> String {
    format!("{:+.3}", a.as_secs_f64() * 1e3 - b.as_secs_f64() * 1e3)
}

fn targets(s: &mut Summary, runs: &RealRuns, m: &Sampled) {
    let ratio_p99 = ratio_of(m.cached.p99(), m.floor.p99());
    s.target(
        "ratio_p99_target",
        format!("prepare-real ratio_p99 <= {RATIO_P99_TARGET} (from the cache, against the empty call + one checkpoint write + the lookup)"),
        ratio_p99 <= RATIO_P99_TARGET,
        format!(
            "{ratio_p99:.2}; ratio_p50 {:.2}; cache {}",
            ratio_of(m.cached.p50(), m.floor.p50()),
            runs.cache.label()
        ),
    );
    let scheduler = ratio_of(m.scheduler.p99(), m.miss_floor.p99());
    let controller = ratio_of(m.controller.p99(), m.miss_floor.p99());
    let worse = scheduler.max(controller);
    s.target(
        "miss_ratio_p99_target",
        format!("prepare-real miss_ratio_p99 <= {MISS_RATIO_P99_TARGET} (prepared right after the allocation was written, against one GET + the floor above; the worse of kube-scheduler's and kerf-controller's writes)"),
        worse <= MISS_RATIO_P99_TARGET,
        format!("{worse:.2}; kube-scheduler's {scheduler:.2}, kerf-controller's {controller:.2}"),
    );
}

/// The run's counts and the series' percentiles.
fn figures(s: &mut Summary, runs: &RealRuns, m: &Sampled) {
    s.figure("claims", runs.claims)
        .figure("fs", &runs.fs_type)
        .figure("cdi_fs", &runs.cdi_fs_type)
        .figure("api_latency_ms", ms(runs.api_latency))
        .figure("cache", runs.cache.label())
        .figure("cache_hits", runs.claims.saturating_sub(runs.cached_gets))
        .figure("cache_gets", runs.cached_gets)
        .figure("p50_ms", ms(m.cached.p50()))
        .figure("p99_ms", ms(m.cached.p99()))
        .figure("max_ms", ms(m.cached.max()))
        .figure("floor_p50_ms", ms(m.floor.p50()))
        .figure("floor_p99_ms", ms(m.floor.p99()))
        .figure("ratio_p50", ratio(m.cached.p50(), m.floor.p50()))
        .figure("ratio_p99", ratio(m.cached.p99(), m.floor.p99()))
        .figure("unprepare_p50_ms", ms(m.cached_un.p50()))
        .figure("get_gets", runs.get_gets)
        .figure("get_p50_ms", ms(m.get.p50()))
        .figure("get_p99_ms", ms(m.get.p99()))
        .figure("miss_floor_p50_ms", ms(m.miss_floor.p50()))
        .figure("miss_floor_p99_ms", ms(m.miss_floor.p99()))
        .figure("scheduler_gets", runs.scheduler_gets)
        .figure("scheduler_p50_ms", ms(m.scheduler.p50()))
        .figure("scheduler_p99_ms", ms(m.scheduler.p99()))
        .figure(
            "scheduler_ratio_p99",
            ratio(m.scheduler.p99(), m.miss_floor.p99()),
        )
        .figure("controller_gets", runs.controller_gets)
        .figure("controller_p50_ms", ms(m.controller.p50()))
        .figure("controller_p99_ms", ms(m.controller.p99()))
        .figure(
            "controller_ratio_p99",
            ratio(m.controller.p99(), m.miss_floor.p99()),
        )
        .figure("api_get_p50_ms", ms(m.api.p50()))
        .figure("api_get_p99_ms", ms(m.api.p99()))
        .figure("checkpoint_write_p50_ms", ms(m.checkpoint.p50()))
        .figure("checkpoint_write_p99_ms", ms(m.checkpoint.p99()))
        .figure("fsynced_write_p50_ms", ms(m.no_dir_sync.p50()))
        .figure("fsynced_write_p99_ms", ms(m.no_dir_sync.p99()))
        .figure("plain_writes_p50_ms", ms(m.plain.p50()))
        .figure("rpc_p50_ms", ms(m.rpc.p50()))
        .figure("lookup_p50_us", us(m.lookup.p50()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(api: u64, checkpoint: u64, plain: u64, rpc: u64) -> PartMedians {
        PartMedians {
            api: Duration::from_micros(api),
            checkpoint: Duration::from_micros(checkpoint),
            plain: Duration::from_micros(plain),
            rpc: Duration::from_micros(rpc),
        }
    }

    #[test]
    fn shares_count_the_api_only_for_the_gets_made_and_leave_the_rest() {
        let prepare = Duration::from_millis(2);
        let from_cache = Shares::of(prepare, 0.0, parts(1000, 800, 100, 100));
        assert!(from_cache.api.abs() < 1e-9);
        assert!((from_cache.writes - 0.4).abs() < 1e-9);
        assert!((from_cache.grpc - 0.05).abs() < 1e-9);
        assert!((from_cache.rest - 0.55).abs() < 1e-9);
        let slow_files = Shares::of(prepare, 0.0, parts(1000, 800, 900, 100));
        assert!((slow_files.writes - 0.45).abs() < 1e-9);
        let with_get = Shares::of(prepare, 1.0, parts(1000, 800, 100, 100));
        assert!((with_get.api - 0.5).abs() < 1e-9);
        assert!((with_get.rest - 0.05).abs() < 1e-9);
    }

    #[test]
    fn shares_stay_between_zero_and_one_when_the_parts_outgrow_the_whole() {
        let s = Shares::of(Duration::from_millis(1), 2.0, parts(900, 900, 500, 300));
        for share in [s.api, s.writes, s.grpc, s.rest] {
            assert!((0.0..=1.0).contains(&share), "{s:?}");
        }
        assert!(s.rest.abs() < 1e-9);
        assert!((per_prepare(3, 0) - 3.0).abs() < 1e-9);
    }
}
