//! The built-in MIG catalogues and the shared-counter model of dynamic MIG.
//!
//! The exhaustive test is what keeps the scheduler from handing out two placements that
//! cannot coexist: for every catalogue, a set of placements fits the GPU's counters exactly
//! when the placements do not overlap and no profile has more instances than NVML allows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests may fail loudly.

use std::collections::BTreeMap;

use kerf_core::inventory::{MigDevice, MigPlacement};
use kerf_core::mig_catalog::{
    self, A100_SXM4_40GB, A100_SXM4_80GB, CatalogPlacement, GpuMigCatalog, H100_SXM5_80GB,
    conflicts, gpu_counters, placement_consumption,
};

const PRODUCTS: [&str; 3] = [A100_SXM4_40GB, A100_SXM4_80GB, H100_SXM5_80GB];

fn catalog(product: &str) -> &'static GpuMigCatalog {
    mig_catalog::catalog_for(product).unwrap()
}

/// Whether the placements' total consumption fits the GPU's counters.
fn fits(catalog: &GpuMigCatalog, set: &[CatalogPlacement<'_>]) -> bool {
    let capacity = gpu_counters(catalog);
    let mut used: BTreeMap<String, u64> = BTreeMap::new();
    for p in set {
        for (name, value) in placement_consumption(p.profile, p.placement) {
            assert!(
                capacity.contains_key(&name),
                "counter {name} is not published"
            );
            *used.entry(name).or_default() += value;
        }
    }
    used.iter().all(|(name, value)| *value <= capacity[name])
}

/// Every set of pairwise non-overlapping placements, built by adding placements in catalogue
/// order.
fn non_overlapping_sets(catalog: &GpuMigCatalog) -> Vec<Vec<CatalogPlacement<'_>>> {
    fn extend<'a>(
        all: &[CatalogPlacement<'a>],
        from: usize,
        current: &mut Vec<CatalogPlacement<'a>>,
        out: &mut Vec<Vec<CatalogPlacement<'a>>>,
    ) {
        out.push(current.clone());
        for i in from..all.len() {
            if current
                .iter()
                .all(|c| !conflicts(c.placement, all[i].placement))
            {
                current.push(all[i]);
                extend(all, i + 1, current, out);
                current.pop();
            }
        }
    }
    let all: Vec<CatalogPlacement<'_>> = catalog.placements().collect();
    let mut out = Vec::new();
    extend(&all, 0, &mut Vec::new(), &mut out);
    out
}

fn within_instance_counts(set: &[CatalogPlacement<'_>]) -> bool {
    let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
    for p in set {
        *counts.entry(p.profile.name.as_str()).or_default() += 1;
    }
    set.iter()
        .all(|p| counts[p.profile.name.as_str()] <= p.profile.instance_count)
}

#[test]
fn a_set_fits_the_counters_exactly_when_the_hardware_allows_it() {
    for product in PRODUCTS {
        let catalog = catalog(product);
        let sets = non_overlapping_sets(catalog);
        assert!(sets.len() > 1000, "{product}: only {} sets", sets.len());
        let mut maximal = 0;
        for set in &sets {
            let allowed = within_instance_counts(set);
            assert_eq!(
                fits(catalog, set),
                allowed,
                "{product}: {:?}",
                set.iter().map(|p| p.device_name(0)).collect::<Vec<_>>()
            );
            let is_maximal = catalog
                .placements()
                .all(|p| set.iter().any(|s| conflicts(s.placement, p.placement)));
            if allowed && is_maximal {
                maximal += 1;
            }
        }
        assert!(maximal > 10, "{product}: {maximal} maximal sets");
    }
}

#[test]
fn overlapping_placements_never_fit_together() {
    for product in PRODUCTS {
        let catalog = catalog(product);
        let all: Vec<CatalogPlacement<'_>> = catalog.placements().collect();
        let mut pairs = 0;
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                if conflicts(a.placement, b.placement) {
                    pairs += 1;
                    assert!(
                        !fits(catalog, &[*a, *b]),
                        "{product}: {} and {}",
                        a.device_name(0),
                        b.device_name(0)
                    );
                }
            }
        }
        assert!(pairs > 50, "{product}: {pairs}");
    }
}

#[test]
fn the_whole_gpu_excludes_every_placement() {
    for product in PRODUCTS {
        let catalog = catalog(product);
        let capacity = gpu_counters(catalog);
        for p in catalog.placements() {
            let consumed = placement_consumption(p.profile, p.placement);
            let fits_beside_whole_gpu = consumed
                .iter()
                .all(|(name, value)| capacity[name] + value <= capacity[name]);
            assert!(!fits_beside_whole_gpu, "{product}: {}", p.device_name(0));
        }
    }
}

#[test]
fn conflicts_is_memory_slice_overlap() {
    let p = |start, size| MigPlacement { start, size };
    assert!(conflicts(p(0, 4), p(3, 1)));
    assert!(conflicts(p(3, 1), p(0, 4)));
    assert!(conflicts(p(2, 2), p(2, 2)));
    assert!(!conflicts(p(0, 4), p(4, 4)));
    assert!(!conflicts(p(6, 1), p(4, 2)));
    assert!(conflicts(p(0, 8), p(7, 1)));
}

#[test]
fn catalogues_have_the_published_geometry() {
    for product in PRODUCTS {
        let catalog = catalog(product);
        assert_eq!(catalog.memory_slice_count, 8);
        assert_eq!(catalog.compute_slice_count, 7);
        assert_eq!(catalog.placements().count(), 25, "{product}");
        assert_eq!(
            catalog
                .placements()
                .filter(|p| !p.profile.has_media_extensions())
                .count(),
            18,
            "{product}"
        );
        let counters = gpu_counters(catalog);
        assert_eq!(counters.len(), 16, "{product}: {counters:?}");
        assert!(counters.keys().all(|k| is_dns_label(k)), "{counters:?}");
        for p in catalog.placements() {
            let name = p.device_name(31);
            assert!(name.len() <= 63 && is_dns_label(&name), "{name}");
            assert!(p.placement.start + p.placement.size <= 8);
        }
    }
    let a100 = catalog(A100_SXM4_40GB);
    let small = a100.profile("1g.5gb").unwrap();
    assert_eq!((small.gi_profile_id, small.memory_mib), (19, 4864));
    assert_eq!(a100.profile_by_id(9).unwrap().name, "3g.20gb");
    assert_eq!(
        a100.profile("3g.20gb").unwrap().placements,
        [
            MigPlacement { start: 0, size: 4 },
            MigPlacement { start: 4, size: 4 }
        ]
    );
    assert!(mig_catalog::catalog_for("NVIDIA L4").is_none());
    let h100 = catalog(H100_SXM5_80GB);
    assert_eq!(
        gpu_counters(h100)[mig_catalog::COUNTER_MULTIPROCESSORS],
        132
    );
    assert_eq!(gpu_counters(h100)["memory"], 81152 << 20);
}

/// A placement's published name is the name the static MIG device it becomes has, so a
/// created instance keeps the name it was allocated under.
#[test]
fn a_placement_is_named_like_the_mig_device_it_becomes() {
    let catalog = catalog(H100_SXM5_80GB);
    let me = catalog.profile("1g.10gb+me").unwrap();
    let placement = CatalogPlacement {
        profile: me,
        placement: me.placements[3],
    };
    assert_eq!(placement.device_name(0), "gpu-0-mig-1g-10gb-me-3");
    let device = MigDevice {
        profile: me.name.clone(),
        placement: me.placements[3],
        gi_id: 11,
        ci_id: 0,
        uuid: "MIG-x".into(),
        memory_bytes: me.memory_bytes(),
        multiprocessors: me.multiprocessors,
        gi_cap_minor: 1,
        ci_cap_minor: 2,
    };
    assert_eq!(device.device_name(0), placement.device_name(0));
    assert_eq!(
        catalog.placement_named(0, "gpu-0-mig-1g-10gb-me-3"),
        Some(placement)
    );
    assert_eq!(catalog.placement_named(1, "gpu-0-mig-1g-10gb-me-3"), None);
    // Names are unique per GPU.
    let mut names: Vec<String> = catalog.placements().map(|p| p.device_name(0)).collect();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 25);
}

#[test]
fn consumption_covers_the_placements_memory_slices() {
    let catalog = catalog(A100_SXM4_40GB);
    let three = catalog.profile("3g.20gb").unwrap();
    let consumed = placement_consumption(three, MigPlacement { start: 4, size: 4 });
    let slices: Vec<&str> = consumed
        .keys()
        .filter(|k| k.starts_with(mig_catalog::COUNTER_MEMORY_SLICE_PREFIX))
        .map(String::as_str)
        .collect();
    assert_eq!(
        slices,
        [
            "memory-slice-4",
            "memory-slice-5",
            "memory-slice-6",
            "memory-slice-7"
        ]
    );
    assert_eq!(consumed["compute-slices"], 3);
    assert_eq!(consumed["memory"], 19968 << 20);
    assert!(
        !consumed.contains_key("encoders"),
        "zero consumption is left out"
    );
}

#[test]
fn a_catalogue_round_trips_through_json() {
    let catalog = catalog(A100_SXM4_80GB);
    let text = serde_json::to_string(catalog).unwrap();
    assert!(text.contains("\"giProfileId\":19"), "{text}");
    let back: GpuMigCatalog = serde_json::from_str(&text).unwrap();
    assert_eq!(&back, catalog);
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}
