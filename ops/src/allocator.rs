//! The global allocator of kerf's binaries: [`global_allocator!`](crate::global_allocator!)
//! declares it in a binary's root, so the choice and its reasons live here once.
//!
//! mimalloc rather than glibc's malloc, for measured reasons that differ per binary:
//!
//! - **kerf-kubelet-plugin** and **kerf** (whose `demo` and `bench` run the plugin in
//!   process): the prepare path allocates from many threads (gRPC workers, the blocking pool
//!   of the file writers), where glibc's malloc spent a quarter of the CPU time of 64
//!   concurrent prepares (see docs/performance.md).
//! - **kerf-controller**: the controller allocates on every watch event, admission review and
//!   reconcile (heaptrack counted 12 million allocations in a 500-node burst, 128,000 a
//!   second), across the runtime's worker threads, and with glibc the leader spent about 1.5x
//!   the CPU per pod. Measured with `kerf-bench controller-footprint` (500 nodes of 8 H100,
//!   1000 slice claims, 2 replicas, 2-core host shared with builds), two pairs of runs of one
//!   source: leader CPU per pod 7.0 / 6.2 ms with mimalloc against 9.9 / 11.4 ms with glibc,
//!   burst 28.3 / 23.7 s against 32.3 / 31.7 s. The price was memory, pages mimalloc keeps
//!   rather than kerf's data: with mimalloc's defaults it commits each arena up front and keeps
//!   freed pages for a second, and the leader held 96–104 MiB where glibc held 77 MiB (after
//!   the slice cache was compacted). The Deployment (`deploy/helm/kerf/templates/controller.yaml`) therefore
//!   sets `MIMALLOC_ARENA_EAGER_COMMIT=0`, `MIMALLOC_PAGE_COMMIT_ON_DEMAND=1`,
//!   `MIMALLOC_PAGE_FULL_RETAIN=0` and `MIMALLOC_PURGE_DELAY=0` (mimalloc reads its options
//!   from the environment; setting them from Rust would need `unsafe`): 57.9–62.2 MiB in four
//!   runs (the first and last setting alone: 58.8–69.9 MiB in six), less than glibc, at no CPU
//!   cost the runs could tell apart (`kerf-bench controller-footprint`, which starts its
//!   replicas with the Deployment's environment).
//!   Build with `--no-default-features` for the system allocator, and to profile the heap with
//!   heaptrack (which cannot see mimalloc).
//!
//! Each binary has its own cargo feature `mimalloc` (on by default), which enables this
//! crate's feature `mimalloc`. The macro expands in the binary, so its `cfg` reads the
//! binary's own feature: `cargo build -p kerf-controller --no-default-features` gives the
//! controller the system allocator even when another package of the same build enables
//! `kerf-ops/mimalloc`, and libraries, tests and benches that link kerf-ops keep the system
//! allocator (a `#[global_allocator]` in this library would reach every binary that links it
//! once any package of the build enabled the feature).

#[cfg(feature = "mimalloc")]
#[doc(hidden)]
pub use mimalloc::MiMalloc;

/// Declares mimalloc the global allocator of the binary whose root calls it, when that
/// binary's feature `mimalloc` is on; the system allocator otherwise. Why: see
/// [`crate::allocator`].
#[macro_export]
macro_rules! global_allocator {
    () => {
        #[cfg(feature = "mimalloc")]
        #[global_allocator]
        static ALLOCATOR: $crate::allocator::MiMalloc = $crate::allocator::MiMalloc;
    };
}
