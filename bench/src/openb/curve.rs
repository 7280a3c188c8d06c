//! The allocation ratio against arrived demand, computed as the paper's analysis scripts do.
//!
//! Imitates hkust-adsl/kubernetes-scheduler-simulator: after every submitted task the
//! simulator logs `[Alloc]` with the GPU milli in use and the GPU milli arrived so far
//! (`ClusterGpuFragReport` in `pkg/simulator/analysis.go`, `SchedulePods` in
//! `pkg/simulator/simulator.go`); `experiments/analysis/merge_alloc_discrete.py` rounds each
//! line's arrived demand to a whole percent of the cluster's GPUs and its allocation ratio to
//! two decimals, and gives each percent the mean ratio of its lines, or of the lines within
//! one percent of it when it has none.

use super::data::MAX_PERCENT;

/// Allocation ratio (percent of the cluster's GPU milli in use) at arrived demand 0, 1, …,
/// [`MAX_PERCENT`] percent; `None` where no task arrived near that demand.
pub(crate) type Curve = Vec<Option<f64>>;

/// Collects one replay's `[Alloc]` lines.
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    cluster_milli: u64,
    /// Per rounded percent: sum of rounded ratios and how many lines.
    buckets: Vec<(f64, u32)>,
}

impl Recorder {
    /// A recorder for a cluster of `cluster_milli` GPU milli (1000 per GPU).
    pub(crate) fn new(cluster_milli: u64) -> Self {
        Recorder {
            cluster_milli: cluster_milli.max(1),
            buckets: vec![(0.0, 0); MAX_PERCENT + 2],
        }
    }

    /// One task was submitted (placed or not): `arrived` GPU milli so far, `used` in use now.
    #[allow(clippy::cast_precision_loss)] // milli sums are far below 2^52
    pub(crate) fn record(&mut self, arrived: u64, used: u64) {
        let total = self.cluster_milli as f64;
        let arrive = (arrived as f64 * 100.0 / total).round_ties_even();
        let ratio = (used as f64 * 100.0 / total * 100.0).round() / 100.0;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let at = arrive.max(0.0) as usize;
        if let Some(bucket) = self.buckets.get_mut(at) {
            bucket.0 += ratio;
            bucket.1 += 1;
        }
    }

    /// The curve.
    pub(crate) fn finish(&self) -> Curve {
        (0..=MAX_PERCENT)
            .map(|p| {
                let (sum, count) = self.buckets[p];
                if count > 0 {
                    return Some(round2(sum / f64::from(count)));
                }
                let near = &self.buckets[p.saturating_sub(1)..=p + 1];
                let (sum, count) = near
                    .iter()
                    .fold((0.0, 0), |(s, c), (bs, bc)| (s + bs, c + bc));
                (count > 0).then(|| round2(sum / f64::from(count)))
            })
            .collect()
    }
}

fn round2(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}

/// The mean of `curves` at `percent`, over the curves that have a value there.
pub(crate) fn mean_at(curves: &[Curve], percent: usize) -> Option<f64> {
    let values: Vec<f64> = curves
        .iter()
        .filter_map(|c| c.get(percent).copied().flatten())
        .collect();
    #[allow(clippy::cast_precision_loss)]
    let n = values.len() as f64;
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / n)
}

/// The mean curve of `curves`.
pub(crate) fn mean_curve(curves: &[Curve]) -> Curve {
    (0..=MAX_PERCENT).map(|p| mean_at(curves, p)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_percent_is_the_mean_of_its_lines_or_of_its_neighbours() {
        let mut r = Recorder::new(100_000);
        r.record(0, 0);
        // 1.0 % and 1.4 % arrived round to 1; 0.5 rounds to even (0).
        r.record(500, 500);
        r.record(1000, 1000);
        r.record(1400, 1200);
        // Nothing near 2 %, 3 % has a line, 4 % none and none at 5 %: 4 % takes 3 %'s.
        r.record(3000, 2900);
        let curve = r.finish();
        assert_eq!(curve[0], Some(0.25));
        assert_eq!(curve[1], Some(1.1));
        assert_eq!(curve[2], Some(1.7));
        assert_eq!(curve[3], Some(2.9));
        assert_eq!(curve[4], Some(2.9));
        assert_eq!(curve[5], None);
        assert_eq!(mean_at(&[curve.clone(), vec![None; 131]], 3), Some(2.9));
        assert_eq!(mean_curve(&[curve])[5], None);
    }
}
