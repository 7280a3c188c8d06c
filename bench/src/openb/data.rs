//! The openb files: the cluster's nodes, a trace's tasks and the paper's simulator results,
//! read from their CSV files with errors that name the file, the line and the field.
//!
//! The files are plain comma-separated text with a header line (no quoting: no field of these
//! files holds a comma). Columns are found by name, so extra columns (`qos`, times) are ignored
//! and the `multigpu*` traces, which have no `gpu_spec` column, read as unconstrained.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The node list the paper's simulator uses: GPU nodes only (its `data/prepare_input.sh`
/// copies `openb_node_list_gpu_node.yaml` into every trace folder).
pub(crate) const NODE_FILE: &str = "openb_node_list_gpu_node.csv";
/// The paper's allocation ratios.
pub(crate) const EXPECTED_FILE: &str = "expected_allocation.csv";
/// The last arrived demand, in percent of the cluster's GPUs, of [`EXPECTED_FILE`]'s columns.
pub(crate) const MAX_PERCENT: usize = 130;
/// Prefix and suffix of a trace's file: `openb_pod_list_<trace>.csv`.
const TRACE_PREFIX: &str = "openb_pod_list_";
const TRACE_SUFFIX: &str = ".csv";

/// One node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeRow {
    /// `sn`.
    pub(crate) name: String,
    /// `cpu_milli`.
    pub(crate) milli_cpu: i64,
    /// `memory_mib`.
    pub(crate) memory_mib: i64,
    /// `gpu`: how many GPUs.
    pub(crate) gpus: u32,
    /// `model`, e.g. `V100M16`; empty for a node without GPUs.
    pub(crate) model: String,
}

/// One task of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TaskRow {
    /// `name`.
    pub(crate) name: String,
    /// `cpu_milli`.
    pub(crate) milli_cpu: i64,
    /// `memory_mib`.
    pub(crate) memory_mib: i64,
    /// `num_gpu`: 0–8.
    pub(crate) num_gpu: u32,
    /// `gpu_milli`: thousandths of each GPU (1000 for whole GPUs).
    pub(crate) gpu_milli: u32,
    /// `gpu_spec`: the models the task may run on; empty for any.
    pub(crate) gpu_spec: Vec<String>,
}

/// The paper's results for one trace, policy and seed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ExpectedRow {
    /// `workload` without its `openb_pod_list_` prefix, e.g. `default`.
    pub(crate) trace: String,
    /// `sc_policy` without its number, e.g. `FGD`.
    pub(crate) policy: String,
    /// `seed`.
    pub(crate) seed: u64,
    /// Allocation ratio in percent at arrived demand 0, 1, …, 130 percent.
    pub(crate) ratios: Vec<f64>,
}

/// A CSV file's header and rows, each row with its line number.
struct Table {
    path: PathBuf,
    header: Vec<String>,
    rows: Vec<(usize, Vec<String>)>,
}

impl Table {
    fn read(path: &Path) -> Result<Table> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
        Table::parse(path, &text)
    }

    fn parse(path: &Path, text: &str) -> Result<Table> {
        let mut lines = text.lines().enumerate().map(|(at, line)| (at + 1, line));
        let header = lines
            .next()
            .map(|(_, line)| split(line))
            .filter(|h| h.iter().any(|f| !f.is_empty()))
            .ok_or_else(|| data_error(path, 1, "header", "the file is empty".into()))?;
        let rows = lines
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(at, line)| (at, split(line)))
            .collect();
        Ok(Table {
            path: path.to_owned(),
            header,
            rows,
        })
    }

    /// The index of column `name`; an error when the header has none.
    fn column(&self, name: &str) -> Result<usize> {
        self.header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| data_error(&self.path, 1, name, "no such column".into()))
    }

    /// The field of column `at` on a row, `""` when the row is shorter.
    fn field(row: &[String], at: usize) -> &str {
        row.get(at).map_or("", String::as_str)
    }

    fn number<T: std::str::FromStr>(
        &self,
        line: usize,
        row: &[String],
        (name, at): (&str, usize),
    ) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        let text = Self::field(row, at);
        text.parse().map_err(|e| {
            data_error(
                &self.path,
                line,
                name,
                format!("{text:?} is not a valid number ({e})"),
            )
        })
    }
}

fn split(line: &str) -> Vec<String> {
    line.trim_end_matches('\r')
        .split(',')
        .map(|f| f.trim().to_owned())
        .collect()
}

fn data_error(path: &Path, line: usize, field: &str, reason: String) -> Error {
    Error::Data {
        path: path.to_owned(),
        line,
        field: field.to_owned(),
        reason,
    }
}

/// The nodes of `dir`'s [`NODE_FILE`].
///
/// # Errors
/// [`Error::Io`] when the file cannot be read, [`Error::Data`] for a missing column, a field
/// that is not a number, or a GPU node without a model.
pub(crate) fn read_nodes(dir: &Path) -> Result<Vec<NodeRow>> {
    parse_nodes(&Table::read(&dir.join(NODE_FILE))?)
}

fn parse_nodes(table: &Table) -> Result<Vec<NodeRow>> {
    let name = table.column("sn")?;
    let cpu = ("cpu_milli", table.column("cpu_milli")?);
    let memory = ("memory_mib", table.column("memory_mib")?);
    let gpus = ("gpu", table.column("gpu")?);
    let model = table.column("model")?;
    let mut nodes = Vec::with_capacity(table.rows.len());
    for (line, row) in &table.rows {
        let node = NodeRow {
            name: Table::field(row, name).to_owned(),
            milli_cpu: table.number(*line, row, cpu)?,
            memory_mib: table.number(*line, row, memory)?,
            gpus: table.number(*line, row, gpus)?,
            model: Table::field(row, model).to_owned(),
        };
        if node.gpus > 0 && node.model.is_empty() {
            return Err(data_error(
                &table.path,
                *line,
                "model",
                format!("node {} has {} GPUs but no model", node.name, node.gpus),
            ));
        }
        nodes.push(node);
    }
    Ok(nodes)
}

/// The tasks of trace `trace` (`openb_pod_list_<trace>.csv` in `dir`), in file order.
///
/// # Errors
/// As [`read_nodes`]; also `num_gpu` above 8 or `gpu_milli` above 1000.
pub(crate) fn read_tasks(dir: &Path, trace: &str) -> Result<Vec<TaskRow>> {
    let path = dir.join(format!("{TRACE_PREFIX}{trace}{TRACE_SUFFIX}"));
    parse_tasks(&Table::read(&path)?)
}

fn parse_tasks(table: &Table) -> Result<Vec<TaskRow>> {
    let name = table.column("name")?;
    let cpu = ("cpu_milli", table.column("cpu_milli")?);
    let memory = ("memory_mib", table.column("memory_mib")?);
    let num_gpu = ("num_gpu", table.column("num_gpu")?);
    let gpu_milli = ("gpu_milli", table.column("gpu_milli")?);
    let spec = table.column("gpu_spec").ok();
    let mut tasks = Vec::with_capacity(table.rows.len());
    for (line, row) in &table.rows {
        let task = TaskRow {
            name: Table::field(row, name).to_owned(),
            milli_cpu: table.number(*line, row, cpu)?,
            memory_mib: table.number(*line, row, memory)?,
            num_gpu: table.number(*line, row, num_gpu)?,
            gpu_milli: table.number(*line, row, gpu_milli)?,
            gpu_spec: spec
                .map(|at| Table::field(row, at))
                .unwrap_or_default()
                .split('|')
                .filter(|m| !m.is_empty())
                .map(str::to_owned)
                .collect(),
        };
        let bad = if task.num_gpu > 8 {
            Some(("num_gpu", format!("{} GPUs is more than 8", task.num_gpu)))
        } else if task.gpu_milli > 1000 {
            Some(("gpu_milli", format!("{} is more than 1000", task.gpu_milli)))
        } else if task.milli_cpu < 0 || task.memory_mib < 0 {
            Some(("cpu_milli", "negative request".to_owned()))
        } else {
            None
        };
        if let Some((field, reason)) = bad {
            return Err(data_error(&table.path, *line, field, reason));
        }
        tasks.push(task);
    }
    Ok(tasks)
}

/// The traces of `dir`: every `openb_pod_list_<trace>.csv`, by name.
///
/// # Errors
/// [`Error::Io`] when the directory cannot be listed.
pub(crate) fn traces(dir: &Path) -> Result<Vec<String>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    let mut traces = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(trace) = name
            .strip_prefix(TRACE_PREFIX)
            .and_then(|n| n.strip_suffix(TRACE_SUFFIX))
        {
            traces.push(trace.to_owned());
        }
    }
    traces.sort();
    Ok(traces)
}

/// The paper's results in `dir`'s [`EXPECTED_FILE`]; an empty list when there is no such
/// file (the bench then prints kerf's figures alone).
///
/// # Errors
/// [`Error::Io`] for a file that exists but cannot be read, [`Error::Data`] as
/// [`read_nodes`].
pub(crate) fn read_expected(dir: &Path) -> Result<Vec<ExpectedRow>> {
    let path = dir.join(EXPECTED_FILE);
    if !path.exists() {
        return Ok(Vec::new());
    }
    parse_expected(&Table::read(&path)?)
}

fn parse_expected(table: &Table) -> Result<Vec<ExpectedRow>> {
    let trace = table.column("workload")?;
    let policy = table.column("sc_policy")?;
    let seed = ("seed", table.column("seed")?);
    let names: Vec<String> = (0..=MAX_PERCENT).map(|p| p.to_string()).collect();
    let percents: Vec<(&str, usize)> = names
        .iter()
        .map(|name| Ok((name.as_str(), table.column(name)?)))
        .collect::<Result<_>>()?;
    let mut rows = Vec::with_capacity(table.rows.len());
    for (line, row) in &table.rows {
        let workload = Table::field(row, trace);
        let sc_policy = Table::field(row, policy);
        rows.push(ExpectedRow {
            trace: workload
                .strip_prefix(TRACE_PREFIX)
                .unwrap_or(workload)
                .to_owned(),
            // `06-FGD` -> `FGD`.
            policy: sc_policy
                .split_once('-')
                .map_or(sc_policy, |(_, name)| name)
                .to_owned(),
            seed: table.number(*line, row, seed)?,
            ratios: percents
                .iter()
                .map(|column| table.number(*line, row, *column))
                .collect::<Result<_>>()?,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> Table {
        Table::parse(Path::new("dir/file.csv"), text).unwrap()
    }

    fn message(result: Result<impl std::fmt::Debug>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn nodes_read_by_column_name() {
        let nodes = parse_nodes(&table(
            "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\r\n\nn1,32000,131072,0,\n",
        ))
        .unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(
            nodes[0],
            NodeRow {
                name: "n0".into(),
                milli_cpu: 64_000,
                memory_mib: 262_144,
                gpus: 2,
                model: "P100".into()
            }
        );
        assert_eq!(nodes[1].model, "");
    }

    #[test]
    fn tasks_with_and_without_a_gpu_spec_column() {
        let tasks = parse_tasks(&table(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n\
             t0,4000,15258,1,470,V100M16|V100M32,LS\nt1,8000,0,0,0,,BE\n",
        ))
        .unwrap();
        assert_eq!(tasks[0].gpu_spec, ["V100M16", "V100M32"]);
        assert_eq!((tasks[0].num_gpu, tasks[0].gpu_milli), (1, 470));
        assert!(tasks[1].gpu_spec.is_empty());
        let bare = parse_tasks(&table(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nt0,88000,327680,8,1000\n",
        ))
        .unwrap();
        assert_eq!(bare[0].num_gpu, 8);
        assert!(bare[0].gpu_spec.is_empty());
    }

    #[test]
    fn errors_name_the_file_the_line_and_the_field() {
        let bad_number = parse_tasks(&table(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nt0,1000,1,1,500\nt1,lots,1,1,500\n",
        ));
        let text = message(bad_number);
        assert!(
            text.starts_with("dir/file.csv:3: cpu_milli: \"lots\""),
            "{text}"
        );
        let missing = message(parse_tasks(&table("name,cpu_milli\nt0,1\n")));
        assert_eq!(missing, "dir/file.csv:1: memory_mib: no such column");
        let too_many = message(parse_tasks(&table(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nt0,1,1,9,1000\n",
        )));
        assert!(too_many.contains(":2: num_gpu: 9 GPUs"), "{too_many}");
        let modelless = message(parse_nodes(&table(
            "sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,2,\n",
        )));
        assert!(
            modelless.contains(":2: model: node n0 has 2 GPUs"),
            "{modelless}"
        );
        let empty = Table::parse(Path::new("e.csv"), "").map(|_| ());
        assert_eq!(message(empty), "e.csv:1: header: the file is empty");
    }

    #[test]
    fn expected_rows_name_trace_policy_seed_and_every_percent() {
        let header: Vec<String> = (0..=MAX_PERCENT).map(|p| p.to_string()).collect();
        let values: Vec<String> = (0..=MAX_PERCENT)
            .map(|p| format!("{}.5", p.min(95)))
            .collect();
        let text = format!(
            "workload,sc_policy,tune,seed,total_gpus,{}\nopenb_pod_list_default,06-FGD,1.3,42,6212,{}\n",
            header.join(","),
            values.join(",")
        );
        let rows = parse_expected(&table(&text)).unwrap();
        assert_eq!(rows[0].trace, "default");
        assert_eq!(rows[0].policy, "FGD");
        assert_eq!(rows[0].seed, 42);
        assert_eq!(rows[0].ratios.len(), MAX_PERCENT + 1);
        assert!((rows[0].ratios[100] - 95.5).abs() < 1e-9);
    }

    #[test]
    fn traces_are_the_pod_list_files_of_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["openb_pod_list_b.csv", "openb_pod_list_a.csv", "notes.csv"] {
            std::fs::write(dir.path().join(name), "x\n").unwrap();
        }
        assert_eq!(traces(dir.path()).unwrap(), ["a", "b"]);
        assert!(read_expected(dir.path()).unwrap().is_empty());
        let missing = message(read_nodes(&dir.path().join("nowhere")));
        assert!(missing.starts_with("read "), "{missing}");
    }
}
