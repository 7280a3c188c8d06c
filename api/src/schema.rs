//! Hand-written schema fragments for fields whose derived schema is wrong or noisy in a CRD.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};

/// The pattern the API server's own quantity fields carry in CRDs.
const QUANTITY_PATTERN: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// A quantity, as the API server's own quantity fields appear in CRDs (k8s-openapi's schema
/// carries a page-long description into every field).
pub(crate) fn quantity(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": true,
    })
}

/// [`quantity`] defaulting to `1Gi`. Not nullable: kube marks optional int-or-string fields
/// nullable, and the API server neither prunes nor defaults an explicit null in a nullable
/// field, which the non-optional Rust field could not decode.
pub(crate) fn quantity_with_default_1gi(generator: &mut SchemaGenerator) -> Schema {
    let mut schema = quantity(generator);
    schema.insert("default".to_owned(), "1Gi".into());
    schema.insert("nullable".to_owned(), false.into());
    schema
}

/// Conditions as a map keyed by `type`, so server-side apply merges them per type.
pub(crate) fn conditions(generator: &mut SchemaGenerator) -> Schema {
    let item = Condition::json_schema(generator);
    json_schema!({
        "type": "array",
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    })
}
