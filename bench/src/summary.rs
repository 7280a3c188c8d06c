//! What a benchmark reports: figures as `key=value`, detail lines and target checks.

use std::fmt::{self, Write as _};

/// The result of one benchmark.
///
/// [`fmt::Display`] renders the one summary line scripts read:
/// `bench NAME key=value key=value …`; [`Summary::report`] renders the detail lines and the
/// target checks before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The benchmark's name, e.g. `prepare`.
    pub name: String,
    /// Figures in the order they were added.
    pub figures: Vec<(String, String)>,
    /// Human-readable lines with the figures and how they were measured.
    pub details: Vec<String>,
    /// The targets this benchmark checks.
    pub targets: Vec<Target>,
}

/// One target and whether this run met it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The target, e.g. `prepare p99 <= 2 ms`.
    pub what: String,
    /// Whether the run met it.
    pub met: bool,
    /// The measured figure, e.g. `0.91 ms`.
    pub actual: String,
}

impl Summary {
    /// An empty summary of benchmark `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Summary {
            name: name.into(),
            figures: Vec::new(),
            details: Vec::new(),
            targets: Vec::new(),
        }
    }

    /// Adds the figure `key=value`. Keys are identifiers; whitespace in a value would break
    /// the line's format and is replaced by `_`.
    pub fn figure(&mut self, key: &str, value: impl fmt::Display) -> &mut Self {
        let value: String = value
            .to_string()
            .chars()
            .map(|c| if c.is_whitespace() { '_' } else { c })
            .collect();
        self.figures.push((key.to_owned(), value));
        self
    }

    /// Adds a detail line.
    pub fn detail(&mut self, line: impl Into<String>) -> &mut Self {
        self.details.push(line.into());
        self
    }

    /// Records a target check and adds the figure `key=met` or `key=missed`.
    pub fn target(
        &mut self,
        key: &str,
        what: impl Into<String>,
        met: bool,
        actual: impl Into<String>,
    ) -> &mut Self {
        self.targets.push(Target {
            what: what.into(),
            met,
            actual: actual.into(),
        });
        self.figure(key, if met { "met" } else { "missed" })
    }

    /// The value of figure `key`, if added.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.figures
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// True when every target was met.
    pub fn all_targets_met(&self) -> bool {
        self.targets.iter().all(|t| t.met)
    }

    /// The full report: detail lines, one line per target, then the summary line.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for line in &self.details {
            out.push_str(line);
            out.push('\n');
        }
        for target in &self.targets {
            let verdict = if target.met { "met" } else { "MISSED" };
            let _ = writeln!(out, "target {}: {verdict} ({})", target.what, target.actual);
        }
        out.push_str(&self.to_string());
        out.push('\n');
        out
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bench {}", self.name)?;
        for (key, value) in &self.figures {
            write!(f, " {key}={value}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_line_is_bench_name_and_key_values_in_order() {
        let mut s = Summary::new("prepare");
        s.figure("n", 2000).figure("p50_ms", "0.812");
        s.target("p99_target", "prepare p99 <= 2 ms", true, "1.1 ms");
        assert_eq!(
            s.to_string(),
            "bench prepare n=2000 p50_ms=0.812 p99_target=met"
        );
        assert_eq!(s.get("p50_ms"), Some("0.812"));
        assert!(s.all_targets_met());
    }

    #[test]
    fn whitespace_in_values_cannot_break_the_line() {
        let mut s = Summary::new("x");
        s.figure("fs", "ext 4\tdisk");
        assert_eq!(s.to_string(), "bench x fs=ext_4_disk");
    }

    #[test]
    fn the_report_ends_with_the_summary_line_and_shouts_misses() {
        let mut s = Summary::new("allocate");
        s.detail("decisions: 20000");
        s.target(
            "rate_target",
            "allocate >= 10000 decisions/s",
            false,
            "9000/s",
        );
        let report = s.report();
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(
            lines,
            [
                "decisions: 20000",
                "target allocate >= 10000 decisions/s: MISSED (9000/s)",
                "bench allocate rate_target=missed",
            ]
        );
        assert!(!s.all_targets_met());
    }
}
