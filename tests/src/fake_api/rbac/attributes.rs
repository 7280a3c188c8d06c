//! What an authorizer is asked about a request: verb, API group, resource, subresource,
//! namespace and name, derived from the HTTP method, the URL path and the query as
//! kube-apiserver's `RequestInfoFactory.NewRequestInfo` derives them (kubernetes/kubernetes
//! `staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go`).

use super::super::routing::Query;

/// The attributes of one request, as `authorizer.AttributesRecord` carries them
/// (kubernetes/kubernetes `staging/src/k8s.io/apiserver/pkg/authorization/authorizer/
/// interfaces.go`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Attributes {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`,
    /// or a synthetic verb such as `associated-node:patch`.
    pub verb: String,
    /// Whether this is a request for a resource (else for a non-resource URL such as `/version`).
    pub resource_request: bool,
    /// The API group, empty for the core group.
    pub api_group: String,
    /// The resource (plural), e.g. `pods`.
    pub resource: String,
    /// The subresource, e.g. `status`; empty for the main resource.
    pub subresource: String,
    /// The namespace, empty for cluster-scoped requests.
    pub namespace: String,
    /// The object's name; empty for collections and creates, set for a list or watch whose
    /// field selector requires `metadata.name=<name>`.
    pub name: String,
    /// The URL path (what non-resource rules match).
    pub path: String,
}

impl Attributes {
    /// The attributes of a request with this HTTP `method`, URL `path` and raw `query`.
    ///
    /// Follows `NewRequestInfo`: `/api/<version>/…` is the core group,
    /// `/apis/<group>/<version>/…` a named one, anything else a non-resource URL; the
    /// deprecated `/watch/` path prefix makes a watch; `namespaces/<ns>/<resource>` is a
    /// namespaced request except for the namespace subresources `status` and `finalize`; a GET
    /// without a name is a `list`, or a `watch` with `watch=true`, and takes the name a
    /// `metadata.name=` field selector requires; a DELETE without a name is a
    /// `deletecollection`.
    pub fn from_request(method: &str, path: &str, query: &str) -> Self {
        let verb = match method.to_ascii_uppercase().as_str() {
            "POST" => "create",
            "GET" | "HEAD" => "get",
            "PUT" => "update",
            "PATCH" => "patch",
            "DELETE" => "delete",
            _ => "",
        };
        let non_resource = || Self {
            verb: verb.to_ascii_lowercase(),
            resource_request: false,
            api_group: String::new(),
            resource: String::new(),
            subresource: String::new(),
            namespace: String::new(),
            name: String::new(),
            path: path.to_owned(),
        };
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (api_group, rest) = match segments.as_slice() {
            ["api", _version, rest @ ..] => (String::new(), rest),
            ["apis", group, _version, rest @ ..] => ((*group).to_owned(), rest),
            _ => return non_resource(),
        };
        let (verb, rest) = match rest {
            ["watch", more @ ..] => ("watch", more),
            _ => (verb, rest),
        };
        let mut attributes = Self {
            verb: verb.to_owned(),
            resource_request: true,
            api_group,
            resource: String::new(),
            subresource: String::new(),
            namespace: String::new(),
            name: String::new(),
            path: path.to_owned(),
        };
        let parts = attributes.take_namespace(rest);
        attributes.take_parts(parts);
        attributes.settle_collection_verb(&Query::parse(query));
        attributes
    }

    /// `namespaces/<ns>/…`: the namespace, and the parts that name the resource.
    fn take_namespace<'a>(&mut self, rest: &'a [&'a str]) -> &'a [&'a str] {
        match rest {
            ["namespaces", namespace, more @ ..] => {
                (*namespace).clone_into(&mut self.namespace);
                match more.first() {
                    Some(next) if !matches!(*next, "status" | "finalize") => more,
                    _ => rest,
                }
            }
            _ => rest,
        }
    }

    /// `resource/name/subresource`.
    fn take_parts(&mut self, parts: &[&str]) {
        if let Some(resource) = parts.first() {
            (*resource).clone_into(&mut self.resource);
        }
        if let Some(name) = parts.get(1) {
            (*name).clone_into(&mut self.name);
        }
        if let Some(subresource) = parts.get(2) {
            (*subresource).clone_into(&mut self.subresource);
        }
    }

    /// A GET or DELETE of a collection: `list`/`watch` (with the name a field selector
    /// requires) or `deletecollection`.
    fn settle_collection_verb(&mut self, query: &Query) {
        if self.name.is_empty() && self.verb == "get" {
            if query.flag("watch") { "watch" } else { "list" }.clone_into(&mut self.verb);
        }
        if self.name.is_empty() && matches!(self.verb.as_str(), "list" | "watch") {
            self.name = query
                .get("fieldSelector")
                .and_then(required_name)
                .unwrap_or_default();
        }
        if self.name.is_empty() && self.verb == "delete" {
            "deletecollection".clone_into(&mut self.verb);
        }
    }

    /// The resource with its subresource, as RBAC rules name it (`pods/status`).
    pub fn combined_resource(&self) -> String {
        if self.subresource.is_empty() {
            self.resource.clone()
        } else {
            format!("{}/{}", self.resource, self.subresource)
        }
    }
}

/// The name a field selector requires (`fields.Selector.RequiresExactMatch("metadata.name")`:
/// a term `metadata.name=<v>` or `metadata.name==<v>` among the comma-separated terms), when
/// it is a valid path segment (`path.IsValidPathSegmentName`: not `.`/`..`, no `/` or `%`).
fn required_name(selector: &str) -> Option<String> {
    selector.split(',').find_map(|term| {
        let value = term
            .strip_prefix("metadata.name==")
            .or_else(|| term.strip_prefix("metadata.name="))?;
        let valid = !matches!(value, "." | "..") && !value.contains(['/', '%']);
        valid.then(|| value.to_owned())
    })
}
