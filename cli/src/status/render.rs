//! The table `kerf status` prints: per node, one row per whole GPU and per MIG device, with
//! text bars for memory and compute and one line per claim; then the GPU fragmentation per
//! node pool (`pools.rs`) and the GpuQuotas (`quotas.rs`).

use std::fmt::Write as _;

use kerf_api::quantity::format_bytes;

use super::model::{ClaimOnDevice, GpuStatus, Health, Memory, MigStatus, NodeStatus, Size, Status};

/// Cells of a bar.
const BAR_WIDTH: u64 = 10;

/// The whole table, ending with a newline.
pub fn table(status: &Status) -> String {
    let mut out = String::new();
    if status.nodes.is_empty() {
        let _ = writeln!(
            out,
            "no ResourceSlices of driver {} (is kerf's kubelet plugin running?)",
            status.driver
        );
    }
    for (i, node) in status.nodes.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        render_node(&mut out, node);
    }
    render_pools(&mut out, status);
    let quotas = super::quotas::render(&status.quotas, gib);
    if !quotas.is_empty() {
        out.push_str("\nGPU quotas\n");
        out.push_str(&align(&quotas));
        out.push_str(&super::quotas::problems(&status.quotas));
    }
    if !status.unmatched_claims.is_empty() {
        out.push_str("\nclaims on devices no current ResourceSlice lists:\n");
        for unmatched in &status.unmatched_claims {
            let _ = writeln!(
                out,
                "  {}/{} on {}: {}",
                unmatched.node,
                unmatched.device,
                claim_name(&unmatched.claim),
                claim_text(&unmatched.claim)
            );
        }
    }
    out
}

/// The pools' section: a table, or the one line saying why there is none; nothing without
/// any node of the driver.
fn render_pools(out: &mut String, status: &Status) {
    if status.nodes.is_empty() {
        return;
    }
    let _ = write!(
        out,
        "\nGPU fragmentation per node pool (label {})",
        status.pool_label
    );
    let Some(pools) = &status.pools else {
        let problem = status
            .pools_problem
            .as_deref()
            .unwrap_or("Nodes not listed");
        let _ = writeln!(out, ": not shown, {problem}");
        return;
    };
    out.push('\n');
    out.push_str(&align(&super::pools::rows(pools)));
    if pools.iter().any(|p| p.fragmented_gpus.is_none()) {
        out.push_str("  fragmentation not known: no allocated claim to learn the workload from\n");
    }
}

fn render_node(out: &mut String, node: &NodeStatus) {
    let pool = &node.pool;
    let incomplete = if i64::try_from(pool.slices).is_ok_and(|n| n < pool.expected_slices) {
        format!(", {} of {} slices seen", pool.slices, pool.expected_slices)
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "node {}  pool {} generation {}{incomplete}",
        node.node, pool.name, pool.generation
    );
    if !node.gpus.is_empty() {
        out.push_str(&align(&gpu_rows(&node.gpus)));
    }
    if !node.mig_devices.is_empty() {
        out.push_str(&align(&mig_rows(&node.mig_devices)));
    }
    for unreadable in &node.unreadable {
        let _ = writeln!(
            out,
            "  unreadable {}: {}",
            unreadable.device, unreadable.reason
        );
    }
}

/// The GPU table of one node: a header, then per GPU a row and one more per claim beyond
/// its first.
fn gpu_rows(gpus: &[GpuStatus]) -> Vec<Vec<String>> {
    let mut rows = vec![header(&[
        "GPU", "PRODUCT", "OWNER", "MEMORY", "COMPUTE", "HEALTH", "CLAIMS",
    ])];
    for gpu in gpus {
        let first = vec![
            gpu.device.clone(),
            gpu.product.clone(),
            owner(gpu.owner),
            memory_bar(gpu.memory),
            bar(
                u64::from(gpu.compute.used_percent),
                100,
                &format!("{}/100%", gpu.compute.used_percent),
            ),
            health(&gpu.health),
        ];
        push_with_claims(&mut rows, first, &gpu.claims);
    }
    rows
}

/// The MIG device table of one node, as [`gpu_rows`].
fn mig_rows(migs: &[MigStatus]) -> Vec<Vec<String>> {
    let mut rows = vec![header(&[
        "MIG DEVICE",
        "PROFILE",
        "PARENT",
        "OWNER",
        "MEMORY",
        "HEALTH",
        "CLAIMS",
    ])];
    for mig in migs {
        let first = vec![
            mig.device.clone(),
            mig.profile.clone(),
            mig.parent_uuid.clone(),
            owner(mig.owner),
            memory_bar(mig.memory),
            health(&mig.health),
        ];
        push_with_claims(&mut rows, first, &mig.claims);
    }
    rows
}

fn header(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

/// The device's row with its first claim, then one row per further claim.
fn push_with_claims(rows: &mut Vec<Vec<String>>, mut first: Vec<String>, claims: &[ClaimOnDevice]) {
    let columns = first.len();
    let mut texts = claims
        .iter()
        .map(|c| format!("{} {}", claim_name(c), claim_text(c)));
    first.push(texts.next().unwrap_or_else(|| "-".to_owned()));
    rows.push(first);
    for text in texts {
        let mut row = vec![String::new(); columns];
        row.push(text);
        rows.push(row);
    }
}

fn claim_name(claim: &ClaimOnDevice) -> String {
    format!("{}/{}", claim.namespace, claim.name)
}

/// `(pod-a) 20Gi 50% MPS, kerf-controller`.
fn claim_text(claim: &ClaimOnDevice) -> String {
    let pods = if claim.pods.is_empty() {
        "(no pod)".to_owned()
    } else {
        format!("({})", claim.pods.join(","))
    };
    let size = match claim.size {
        Size::Whole => "whole".to_owned(),
        Size::Slice {
            memory_bytes,
            compute_percent,
            sharing,
        } => {
            let memory = if memory_bytes == 0 {
                "-".to_owned()
            } else {
                format_bytes(memory_bytes)
            };
            format!("{memory} {compute_percent}% {sharing}")
        }
    };
    let held = match &claim.limits_held_by {
        Some(held) if held.memory == held.compute => format!(", held by {}", held.memory),
        Some(held) => format!(
            ", memory held by {}, compute by {}",
            held.memory, held.compute
        ),
        None => String::new(),
    };
    format!("{pods} {size}, {}{held}", claim.allocator.as_str())
}

fn owner(owner: Option<kerf_api::ownership::Owner>) -> String {
    owner.map_or_else(|| "-".to_owned(), |o| o.as_str().to_owned())
}

fn health(health: &Health) -> String {
    if health.taints.is_empty() {
        return "ok".to_owned();
    }
    let taints: Vec<String> = health
        .taints
        .iter()
        .map(|t| {
            if t.value.is_empty() {
                t.effect.clone()
            } else {
                format!("{} {}", t.value, t.effect)
            }
        })
        .collect();
    let word = if health.healthy {
        "tainted"
    } else {
        "unhealthy"
    };
    format!("{word} ({})", taints.join("; "))
}

fn memory_bar(memory: Memory) -> String {
    bar(
        memory.used,
        memory.total,
        &format!("{}/{}Gi", gib(memory.used), gib(memory.total)),
    )
}

/// Bytes in GiB with one decimal, trailing `.0` dropped: `40`, `79.6`.
fn gib(bytes: u64) -> String {
    // Tenths of a GiB, rounded; exact in integers, no float rounding surprises.
    let tenths = (u128::from(bytes) * 10 + (1 << 29)) >> 30;
    if tenths % 10 == 0 {
        format!("{}", tenths / 10)
    } else {
        format!("{}.{}", tenths / 10, tenths % 10)
    }
}

/// `[####------] label`: `used` of `total` in [`BAR_WIDTH`] cells, rounded to the nearest.
fn bar(used: u64, total: u64, label: &str) -> String {
    let filled = if total == 0 {
        0
    } else {
        let cells = (u128::from(used.min(total)) * u128::from(BAR_WIDTH) + u128::from(total) / 2)
            / u128::from(total);
        u64::try_from(cells).unwrap_or(BAR_WIDTH)
    };
    let filled = usize::try_from(filled).unwrap_or(0);
    let empty = usize::try_from(BAR_WIDTH)
        .unwrap_or(0)
        .saturating_sub(filled);
    format!("[{}{}] {label}", "#".repeat(filled), "-".repeat(empty))
}

/// Rows padded to aligned columns (two spaces apart), indented two spaces.
fn align(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::from("  ");
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_round_to_the_nearest_cell() {
        assert_eq!(bar(0, 80, "x"), "[----------] x");
        assert_eq!(bar(40, 80, "x"), "[#####-----] x");
        assert_eq!(bar(80, 80, "x"), "[##########] x");
        assert_eq!(bar(1, 80, "x"), "[----------] x");
        assert_eq!(bar(5, 0, "x"), "[----------] x");
    }

    #[test]
    fn gibibytes_have_one_decimal() {
        assert_eq!(gib(40 << 30), "40");
        assert_eq!(gib(81_559 << 20), "79.6");
        assert_eq!(gib(0), "0");
    }
}
