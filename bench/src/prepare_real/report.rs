//! The figures, shares and target of `prepare-real`.

use std::time::Duration;

use super::{CacheUse, RealRuns};
use crate::prepare::ratio_of;
use crate::stats::{Samples, ms, percent, ratio, us};
use crate::summary::Summary;

/// Issue 15's target: the real-path prepare's p99 within this factor of its floor's.
const RATIO_P99_TARGET: f64 = 1.3;

/// What each part of a prepare costs at its median, measured on its own.
#[derive(Debug, Clone, Copy)]
struct PartMedians {
    api: Duration,
    durable: Duration,
    plain: Duration,
    rpc: Duration,
}

/// Each part's share of a prepare's median, each between 0 and 1.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shares {
    /// The GETs the prepares made, per prepare, times a GET's median.
    api: f64,
    /// The durable checkpoint write, or the spec and metadata writes without fsync when they
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
        let writes = share(parts.durable.max(parts.plain));
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

/// The summary of a `prepare-real` run.
pub(super) fn summary(runs: &RealRuns) -> Summary {
    let p = &runs.parts;
    let sample = |v: &Vec<Duration>| Samples::new(v.clone());
    let (cached, cached_un, get, get_un) = (
        sample(&p.cached),
        sample(&p.cached_unprepare),
        sample(&p.get),
        sample(&p.get_unprepare),
    );
    let (floor, api, durable, plain, rpc, lookup) = (
        sample(&p.floor),
        sample(&p.api),
        sample(&p.durable),
        sample(&p.plain),
        sample(&p.rpc),
        sample(&p.lookup),
    );
    let medians = PartMedians {
        api: api.p50(),
        durable: durable.p50(),
        plain: plain.p50(),
        rpc: rpc.p50(),
    };
    let cached_shares = Shares::of(
        cached.p50(),
        per_prepare(runs.cached_gets, runs.claims),
        medians,
    );
    let get_shares = Shares::of(get.p50(), per_prepare(runs.get_gets, runs.claims), medians);
    let sizes = &runs.sizes;
    let mut s = Summary::new("prepare-real");
    s.detail(format!(
        "{} claims of each series, one at a time over the plugin's Unix socket (mock H100, 10Gi MPS slice, accounting only); the plugin started as in production (plugin::start, Connections::kube) with a kube client read from a kubeconfig, against the in-memory API server over HTTP answering every request {} ms late; checkpoint and metadata files on {}, CDI specs on {}",
        runs.claims,
        ms(runs.api_latency),
        runs.fs_type,
        runs.cdi_fs_type
    ));
    s.detail(cache_line(runs));
    s.detail(format!(
        "from cache  prepare {}  unprepare {}",
        cached.p50_p99_max_ms(),
        cached_un.p50_p99_ms()
    ));
    s.detail(format!(
        "  floor     {}  (empty NodePrepareResources + 1 durable write of {} bytes + 1 lookup among {} claims)  ratio_p50 {}  ratio_p99 {}",
        floor.p50_p99_max_ms(),
        sizes.checkpoint,
        runs.cache_size,
        ratio(cached.p50(), floor.p50()),
        ratio(cached.p99(), floor.p99())
    ));
    s.detail(format!(
        "with GET    prepare {}  unprepare {}  (unlabelled claims: {} GETs for {} prepares)  ratio_p99 to the floor {}",
        get.p50_p99_max_ms(),
        get_un.p50_p99_ms(),
        runs.get_gets,
        runs.claims,
        ratio(get.p99(), floor.p99())
    ));
    s.detail(format!(
        "parts, each on its own: GET of a claim {};  durable write of the checkpoint ({} B) {};  spec + {} metadata file(s) without fsync ({} B) {};  empty NodePrepareResources {};  map lookup p50 {} us",
        api.p50_p99_ms(),
        sizes.checkpoint,
        durable.p50_p99_ms(),
        sizes.metadata.len(),
        sizes.plain_bytes(),
        plain.p50_p99_ms(),
        rpc.p50_p99_ms(),
        us(lookup.p50())
    ));
    s.detail(format!(
        "share of the prepare p50, from cache: {};  with GET: {}  (API: GETs per prepare x a GET's p50; writes: the durable write or the writes without fsync, whichever is longer, as a prepare makes them at the same time; gRPC: the empty call; rest: the plugin's own work and anything not measured on its own, such as a second fsync)",
        cached_shares.line(),
        get_shares.line()
    ));
    figures(&mut s, runs, [&cached, &cached_un, &get, &floor]);
    s.figure("api_get_p50_ms", ms(api.p50()))
        .figure("api_get_p99_ms", ms(api.p99()))
        .figure("durable_write_p50_ms", ms(durable.p50()))
        .figure("plain_writes_p50_ms", ms(plain.p50()))
        .figure("rpc_p50_ms", ms(rpc.p50()))
        .figure("lookup_p50_us", us(lookup.p50()));
    cached_shares.figures(&mut s, "");
    get_shares.figures(&mut s, "get_");
    let ratio_p99 = ratio_of(cached.p99(), floor.p99());
    s.target(
        "ratio_p99_target",
        format!("prepare-real ratio_p99 <= {RATIO_P99_TARGET} (from the cache, against the empty call + one fsync + the lookup)"),
        ratio_p99 <= RATIO_P99_TARGET,
        format!(
            "{ratio_p99:.2}; ratio_p50 {:.2}; cache {}",
            ratio_of(cached.p50(), floor.p50()),
            runs.cache.label()
        ),
    );
    s
}

/// The run's counts and the series' percentiles.
fn figures(s: &mut Summary, runs: &RealRuns, [cached, cached_un, get, floor]: [&Samples; 4]) {
    s.figure("claims", runs.claims)
        .figure("fs", &runs.fs_type)
        .figure("cdi_fs", &runs.cdi_fs_type)
        .figure("api_latency_ms", ms(runs.api_latency))
        .figure("cache", runs.cache.label())
        .figure("cache_hits", runs.claims.saturating_sub(runs.cached_gets))
        .figure("cache_gets", runs.cached_gets)
        .figure("p50_ms", ms(cached.p50()))
        .figure("p99_ms", ms(cached.p99()))
        .figure("max_ms", ms(cached.max()))
        .figure("floor_p50_ms", ms(floor.p50()))
        .figure("floor_p99_ms", ms(floor.p99()))
        .figure("ratio_p50", ratio(cached.p50(), floor.p50()))
        .figure("ratio_p99", ratio(cached.p99(), floor.p99()))
        .figure("unprepare_p50_ms", ms(cached_un.p50()))
        .figure("get_gets", runs.get_gets)
        .figure("get_p50_ms", ms(get.p50()))
        .figure("get_p99_ms", ms(get.p99()))
        .figure("get_ratio_p99", ratio(get.p99(), floor.p99()));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(api: u64, durable: u64, plain: u64, rpc: u64) -> PartMedians {
        PartMedians {
            api: Duration::from_micros(api),
            durable: Duration::from_micros(durable),
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
