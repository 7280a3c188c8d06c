//! The product crates have no module circle of more than two sibling modules
//! ([`kerf_tests::module_graph`]): a circle of three or more is a knot a change cannot start
//! from, because every module in it needs all the others.

use std::path::Path;

use kerf_tests::module_graph::ModuleGraph;

/// The crates whose structure this holds to, as directories of the workspace.
const CRATES: [&str; 4] = ["core", "api", "controller", "kubelet-plugin"];

/// The most siblings allowed to import each other round a loop: two, a module and its closest
/// collaborator.
const MAX_CIRCLE: usize = 2;

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

#[test]
fn no_product_crate_has_a_module_circle_of_more_than_two() {
    let mut found = Vec::new();
    for name in CRATES {
        let graph = ModuleGraph::read(&workspace().join(name).join("src")).unwrap();
        assert!(
            graph.modules().count() > 10,
            "{name}: too few modules found"
        );
        found.extend(
            graph
                .circles_over(MAX_CIRCLE)
                .into_iter()
                .map(|circle| format!("{name}: {circle}")),
        );
    }
    assert!(found.is_empty(), "module circles:\n{}", found.join("\n"));
}

/// A crate on disk for the checker's own tests.
fn write_crate(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    dir
}

#[test]
fn a_circle_of_three_siblings_is_found_and_one_of_two_is_not() {
    let dir = write_crate(&[
        ("lib.rs", "mod a; mod b; mod c; mod d;"),
        ("a.rs", "use crate::b::B; pub struct A;"),
        ("b.rs", "pub struct B(crate::c::C);"),
        // Through a child module and a `super` path.
        ("c.rs", "mod inner; pub struct C;"),
        ("c/inner.rs", "fn f() -> super::super::a::A { todo!() }"),
        ("d.rs", "use crate::a::A; pub struct D;"),
    ]);
    let graph = ModuleGraph::read(dir.path()).unwrap();
    let circles = graph.circles_over(MAX_CIRCLE);
    assert_eq!(circles.len(), 1, "{circles:?}");
    let members: Vec<&String> = circles[0].members.keys().collect();
    assert_eq!(members, ["a", "b", "c"]);
    assert_eq!(
        circles[0].to_string(),
        "3 modules of crate: a -> [b]; b -> [c]; c -> [a];"
    );
    assert!(graph.circles_over(3).is_empty());
}

#[test]
fn test_code_and_parent_child_imports_make_no_circle() {
    let dir = write_crate(&[
        ("lib.rs", "mod a; mod b; mod c; pub use a::inner::X;"),
        (
            "a.rs",
            "pub mod inner; use crate::b::B; #[cfg(test)] mod tests;",
        ),
        ("a/inner.rs", "pub struct X(super::super::c::C);"),
        ("a/tests.rs", "use crate::c::C;"),
        (
            "b.rs",
            "pub struct B; #[cfg(test)] fn t() -> crate::c::C { todo!() }",
        ),
        (
            "c.rs",
            "pub struct C; #[cfg(test)] mod tests { use crate::a::inner::X; }",
        ),
    ]);
    let graph = ModuleGraph::read(dir.path()).unwrap();
    assert!(
        graph.circles_over(1).is_empty(),
        "{:?}",
        graph.circles_over(1)
    );
}
