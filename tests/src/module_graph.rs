//! The module graph of a crate's product code, and its circles: which sibling modules import
//! each other round a loop.
//!
//! Modules are found as rustc finds them, from `lib.rs` (or `main.rs`) through every `mod`
//! item: inline, `name.rs`, `name/mod.rs` or `#[path]`. Test code is left out: a `mod` or any
//! other item under `#[cfg(test)]`. A module imports another when its items name it by a path
//! that starts with `crate`, `super` or `self` (in `use` trees, types, expressions, patterns);
//! the path names the longest known module it starts with. Paths inside macro calls are not
//! parsed, so an import only a macro makes is not seen.
//!
//! Two modules with a common parent form a circle when their subtrees import each other round
//! a loop: an edge between two modules counts as one between the children of their closest
//! common ancestor. A parent and its descendants never form one (a child may use its parent's
//! items and the parent re-exports the child's).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A module's path below its crate root, e.g. `["claims", "watch"]`; empty for the root.
pub type ModulePath = Vec<String>;

/// Why a crate's modules could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    /// A source file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the file system said.
        #[source]
        source: std::io::Error,
    },
    /// A source file is not valid Rust.
    #[error("parsing {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What syn said.
        #[source]
        source: syn::Error,
    },
    /// A `mod name;` whose file is in none of the places rustc looks.
    #[error("module {module} declared in {declared_in} has no file")]
    MissingFile {
        /// The module's path.
        module: String,
        /// The file that declares it.
        declared_in: PathBuf,
    },
}

/// The modules of one crate and which modules each one's items name.
#[derive(Debug, Default)]
pub struct ModuleGraph {
    /// Every module, with the file it is in.
    modules: BTreeMap<ModulePath, PathBuf>,
    /// Per module, the modules it imports.
    imports: BTreeMap<ModulePath, BTreeSet<ModulePath>>,
}

/// Sibling modules that import each other round a loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Circle {
    /// Their common parent.
    pub parent: ModulePath,
    /// The siblings, each with the siblings of the circle it imports.
    pub members: BTreeMap<String, BTreeSet<String>>,
}

impl fmt::Display for Circle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parent = if self.parent.is_empty() {
            "crate".to_owned()
        } else {
            self.parent.join("::")
        };
        write!(f, "{} modules of {parent}:", self.members.len())?;
        for (member, imports) in &self.members {
            let imports: Vec<&str> = imports.iter().map(String::as_str).collect();
            write!(f, " {member} -> [{}];", imports.join(", "))?;
        }
        Ok(())
    }
}

impl ModuleGraph {
    /// Reads the crate whose sources are under `src` (from `lib.rs`, else `main.rs`).
    ///
    /// # Errors
    /// A file cannot be read or parsed, or a declared module has no file.
    pub fn read(src: &Path) -> Result<Self, GraphError> {
        let root = if src.join("lib.rs").exists() {
            src.join("lib.rs")
        } else {
            src.join("main.rs")
        };
        let mut graph = ModuleGraph::default();
        let mut parsed = Vec::new();
        graph.add_file(Vec::new(), &root, &mut parsed)?;
        for (module, items) in &parsed {
            let mut names = PathNames::default();
            for item in items {
                names.visit_item(item);
            }
            let imports = names
                .paths
                .iter()
                .filter_map(|path| graph.resolve(module, path))
                .filter(|target| target != module)
                .collect();
            graph.imports.insert(module.clone(), imports);
        }
        Ok(graph)
    }

    /// Every circle of more than `max` siblings, by parent.
    pub fn circles_over(&self, max: usize) -> Vec<Circle> {
        let mut by_parent: BTreeMap<ModulePath, BTreeMap<String, BTreeSet<String>>> =
            BTreeMap::new();
        for (from, targets) in &self.imports {
            for to in targets {
                let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
                if common == from.len() || common == to.len() {
                    continue;
                }
                by_parent
                    .entry(from[..common].to_vec())
                    .or_default()
                    .entry(from[common].clone())
                    .or_default()
                    .insert(to[common].clone());
            }
        }
        let mut circles = Vec::new();
        for (parent, edges) in by_parent {
            for component in strongly_connected(&edges) {
                if component.len() > max {
                    let members = component
                        .iter()
                        .map(|m| {
                            let inside = edges.get(m).map_or_else(BTreeSet::new, |targets| {
                                targets.intersection(&component).cloned().collect()
                            });
                            (m.clone(), inside)
                        })
                        .collect();
                    circles.push(Circle {
                        parent: parent.clone(),
                        members,
                    });
                }
            }
        }
        circles
    }

    /// The modules found.
    pub fn modules(&self) -> impl Iterator<Item = &ModulePath> {
        self.modules.keys()
    }

    fn add_file(
        &mut self,
        module: ModulePath,
        file: &Path,
        parsed: &mut Vec<(ModulePath, Vec<syn::Item>)>,
    ) -> Result<(), GraphError> {
        let text = std::fs::read_to_string(file).map_err(|source| GraphError::Read {
            path: file.to_owned(),
            source,
        })?;
        let ast = syn::parse_file(&text).map_err(|source| GraphError::Parse {
            path: file.to_owned(),
            source,
        })?;
        let dir = children_dir(file);
        self.add_items(module, file, &dir, ast.items, parsed)
    }

    fn add_items(
        &mut self,
        module: ModulePath,
        file: &Path,
        dir: &Path,
        items: Vec<syn::Item>,
        parsed: &mut Vec<(ModulePath, Vec<syn::Item>)>,
    ) -> Result<(), GraphError> {
        self.modules.insert(module.clone(), file.to_owned());
        let mut own = Vec::new();
        for item in items {
            match item {
                syn::Item::Mod(m) if !is_test(&m.attrs) => {
                    let mut child = module.clone();
                    child.push(m.ident.to_string());
                    if let Some((_, items)) = m.content {
                        let inner = dir.join(m.ident.to_string());
                        self.add_items(child, file, &inner, items, parsed)?;
                    } else {
                        let child_file =
                            module_file(file, dir, &m).ok_or_else(|| GraphError::MissingFile {
                                module: child.join("::"),
                                declared_in: file.to_owned(),
                            })?;
                        self.add_file(child, &child_file, parsed)?;
                    }
                }
                syn::Item::Mod(_) => {}
                item if !is_test(item_attrs(&item)) => own.push(item),
                _ => {}
            }
        }
        parsed.push((module, own));
        Ok(())
    }

    /// The module `path`, named inside `from`, starts with: the longest known one.
    fn resolve(&self, from: &ModulePath, path: &[String]) -> Option<ModulePath> {
        let (mut base, rest) = match path.first().map(String::as_str) {
            Some("crate") => (Vec::new(), &path[1..]),
            Some("self") => (from.clone(), &path[1..]),
            Some("super") => {
                let supers = path.iter().take_while(|s| *s == "super").count();
                let keep = from.len().checked_sub(supers)?;
                (from[..keep].to_vec(), &path[supers..])
            }
            _ => return None,
        };
        let mut found = self.modules.contains_key(&base).then(|| base.clone());
        for segment in rest {
            base.push(segment.clone());
            if self.modules.contains_key(&base) {
                found = Some(base.clone());
            }
        }
        found
    }
}

/// Where the files of a file's child modules are: beside it for `lib.rs`, `main.rs` and
/// `mod.rs`, else in the directory named after it.
fn children_dir(file: &Path) -> PathBuf {
    let parent = file.parent().unwrap_or(Path::new("."));
    match file.file_stem().and_then(|s| s.to_str()) {
        Some("lib" | "main" | "mod") | None => parent.to_owned(),
        Some(stem) => parent.join(stem),
    }
}

/// The file of `mod name;` declared in `file` (children in `dir`): its `#[path]` (relative
/// to the declaring file's directory), `dir/name.rs` or `dir/name/mod.rs`.
fn module_file(file: &Path, dir: &Path, m: &syn::ItemMod) -> Option<PathBuf> {
    let explicit = m.attrs.iter().find_map(|attr| match &attr.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    });
    if let Some(relative) = explicit {
        return Some(file.parent().unwrap_or(Path::new(".")).join(relative));
    }
    let name = m.ident.to_string();
    [
        dir.join(format!("{name}.rs")),
        dir.join(&name).join("mod.rs"),
    ]
    .into_iter()
    .find(|candidate| candidate.exists())
}

/// True for `#[cfg(test)]` (and `#[cfg(all(test, …))]`): code only the tests compile.
fn is_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("cfg")
            && attr.meta.require_list().is_ok_and(|list| {
                list.tokens
                    .to_string()
                    .split(|c: char| !c.is_alphanumeric() && c != '_')
                    .any(|word| word == "test")
            })
    })
}

fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    match item {
        syn::Item::Const(i) => &i.attrs,
        syn::Item::Enum(i) => &i.attrs,
        syn::Item::ExternCrate(i) => &i.attrs,
        syn::Item::Fn(i) => &i.attrs,
        syn::Item::ForeignMod(i) => &i.attrs,
        syn::Item::Impl(i) => &i.attrs,
        syn::Item::Macro(i) => &i.attrs,
        syn::Item::Mod(i) => &i.attrs,
        syn::Item::Static(i) => &i.attrs,
        syn::Item::Struct(i) => &i.attrs,
        syn::Item::Trait(i) => &i.attrs,
        syn::Item::TraitAlias(i) => &i.attrs,
        syn::Item::Type(i) => &i.attrs,
        syn::Item::Union(i) => &i.attrs,
        syn::Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// Every path a module's items name that starts with `crate`, `self` or `super`.
#[derive(Default)]
struct PathNames {
    paths: Vec<Vec<String>>,
}

impl PathNames {
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.record_use(prefix, &n.ident),
            syn::UseTree::Rename(r) => self.record_use(prefix, &r.ident),
            syn::UseTree::Glob(_) => self.record(prefix.clone()),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.use_tree(prefix, tree);
                }
            }
        }
    }

    fn record_use(&mut self, prefix: &[String], ident: &syn::Ident) {
        let mut path = prefix.to_vec();
        if ident != "self" {
            path.push(ident.to_string());
        }
        self.record(path);
    }

    fn record(&mut self, path: Vec<String>) {
        if matches!(
            path.first().map(String::as_str),
            Some("crate" | "self" | "super")
        ) {
            self.paths.push(path);
        }
    }
}

impl<'ast> Visit<'ast> for PathNames {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        // Nested `mod` items are modules of their own, read separately.
        if !matches!(item, syn::Item::Mod(_)) && !is_test(item_attrs(item)) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let attrs = match item {
            syn::ImplItem::Const(i) => &i.attrs,
            syn::ImplItem::Fn(i) => &i.attrs,
            syn::ImplItem::Type(i) => &i.attrs,
            _ => return syn::visit::visit_impl_item(self, item),
        };
        if !is_test(attrs) {
            syn::visit::visit_impl_item(self, item);
        }
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &item.tree);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        self.record(path.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, path);
    }
}

/// Tarjan's strongly connected components of `edges`.
fn strongly_connected(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<BTreeSet<String>>,
    }
    fn connect<'a>(state: &mut State<'a>, node: &'a str) {
        let n = state.index.len();
        state.index.insert(node, n);
        state.low.insert(node, n);
        state.stack.push(node);
        state.on_stack.insert(node);
        for next in state.edges.get(node).into_iter().flatten() {
            let next = next.as_str();
            if !state.index.contains_key(next) {
                connect(state, next);
                let low = state.low[node].min(state.low[next]);
                state.low.insert(node, low);
            } else if state.on_stack.contains(next) {
                let low = state.low[node].min(state.index[next]);
                state.low.insert(node, low);
            }
        }
        if state.low[node] == state.index[node] {
            let mut component = BTreeSet::new();
            while let Some(member) = state.stack.pop() {
                state.on_stack.remove(member);
                component.insert(member.to_owned());
                if member == node {
                    break;
                }
            }
            state.components.push(component);
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for node in edges.keys() {
        if !state.index.contains_key(node.as_str()) {
            connect(&mut state, node);
        }
    }
    state.components
}
