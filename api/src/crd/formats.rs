//! The `format`s of a CRD schema, kept to the ones the API server knows.
//!
//! schemars names Rust's integer widths (`uint8`, `uint32`, ...), which kube-apiserver does
//! not know: it answers every CRD write with `Warning: unrecognized format "uint32"` and
//! ignores the format. [`kubernetes_formats`] turns them into `int32`/`int64` with the range
//! of the Rust type as `minimum`/`maximum`, so the API server still enforces what fits in
//! the field. [`unknown_formats`] lists every format left that the API server would warn about.
//!
//! The known formats are those of `supportedVersionedFormats` and
//! `GetUnrecognizedFormats` in kubernetes/kubernetes
//! `staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/validation/formats.go`:
//! integers `int32`/`int64`, numbers `float`/`double`, strings (or untyped) a fixed list
//! compared after removing `-` (go-openapi's normalisation, so `date-time` is `datetime`),
//! and no format at all on other types. `k8s-short-name`/`k8s-long-name` are known from
//! Kubernetes 1.34, the oldest version kerf supports.

use std::fmt;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
    JSONSchemaPropsOrStringArray,
};

/// String formats kube-apiserver 1.34+ validates, as normalised by go-openapi (no `-`).
const STRING_FORMATS: &[&str] = &[
    "bsonobjectid",
    "uri",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "cidr",
    "mac",
    "uuid",
    "uuid3",
    "uuid4",
    "uuid5",
    "isbn",
    "isbn10",
    "isbn13",
    "creditcard",
    "ssn",
    "hexcolor",
    "rgbcolor",
    "byte",
    "password",
    "date",
    "duration",
    "datetime",
    "quantity",
    "k8sshortname",
    "k8slongname",
];

/// A `format` the API server does not know, and where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownFormat {
    /// Where the schema is in the CRD, e.g.
    /// `spec.versions[v1alpha1].schema.openAPIV3Schema.properties.spec.properties.slicing`.
    pub path: String,
    /// The schema's `type`, empty when it has none.
    pub schema_type: String,
    /// The format as written.
    pub format: String,
}

impl fmt::Display for UnknownFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let known = match self.schema_type.as_str() {
            "integer" => "int32 or int64",
            "number" => "float or double",
            "" | "string" => "one of formats.go's string formats",
            _ => "no format at all on this type",
        };
        write!(
            f,
            "{}: format {:?} on type {:?} is unknown to kube-apiserver (it warns and ignores it; expected {known})",
            self.path,
            self.format,
            if self.schema_type.is_empty() {
                "<none>"
            } else {
                &self.schema_type
            }
        )
    }
}

/// Whether kube-apiserver knows `format` on a schema of type `schema_type` (empty: no type).
pub fn is_known(schema_type: &str, format: &str) -> bool {
    match schema_type {
        "integer" => matches!(format, "int32" | "int64"),
        "number" => matches!(format, "float" | "double"),
        "" | "string" => STRING_FORMATS.contains(&format.replace('-', "").as_str()),
        _ => false,
    }
}

/// Every `format` in `crd`'s version schemas that kube-apiserver does not know.
pub fn unknown_formats(crd: &CustomResourceDefinition) -> Vec<UnknownFormat> {
    let mut found = Vec::new();
    let mut crd = crd.clone();
    for version in &mut crd.spec.versions {
        let path = format!("spec.versions[{}].schema.openAPIV3Schema", version.name);
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            walk(schema, &path, &mut |path, schema| {
                let Some(format) = &schema.format else { return };
                let schema_type = schema.type_.clone().unwrap_or_default();
                if !is_known(&schema_type, format) {
                    found.push(UnknownFormat {
                        path: path.to_owned(),
                        schema_type,
                        format: format.clone(),
                    });
                }
            });
        }
    }
    found
}

/// Rewrites the integer formats schemars derives from Rust types into `int32`/`int64`,
/// narrowing `minimum`/`maximum` to the Rust type's range (an existing tighter bound stays).
pub fn kubernetes_formats(crd: &mut CustomResourceDefinition) {
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            walk(schema, "", &mut |_, schema| rewrite_integer(schema));
        }
    }
}

/// The Kubernetes format and range of an integer format schemars emits.
fn integer_range(format: &str) -> Option<(&'static str, Option<f64>, Option<f64>)> {
    Some(match format {
        "int8" => ("int32", Some(f64::from(i8::MIN)), Some(f64::from(i8::MAX))),
        "int16" => (
            "int32",
            Some(f64::from(i16::MIN)),
            Some(f64::from(i16::MAX)),
        ),
        "uint8" => ("int32", Some(0.0), Some(f64::from(u8::MAX))),
        "uint16" => ("int32", Some(0.0), Some(f64::from(u16::MAX))),
        "uint32" => ("int64", Some(0.0), Some(f64::from(u32::MAX))),
        // Beyond i64::MAX Kubernetes integers cannot go anyway.
        "uint64" | "uint" => ("int64", Some(0.0), None),
        "int" => ("int64", None, None),
        _ => return None,
    })
}

fn rewrite_integer(schema: &mut JSONSchemaProps) {
    if schema.type_.as_deref() != Some("integer") {
        return;
    }
    let Some((format, low, high)) = schema.format.as_deref().and_then(integer_range) else {
        return;
    };
    schema.format = Some(format.to_owned());
    if let Some(low) = low {
        schema.minimum = Some(schema.minimum.map_or(low, |m| m.max(low)));
    }
    if let Some(high) = high {
        schema.maximum = Some(schema.maximum.map_or(high, |m| m.min(high)));
    }
}

/// Calls `visit` on `schema` and every schema nested in it, with its path.
fn walk(
    schema: &mut JSONSchemaProps,
    path: &str,
    visit: &mut dyn FnMut(&str, &mut JSONSchemaProps),
) {
    visit(path, schema);
    for (key, map) in [
        ("properties", &mut schema.properties),
        ("patternProperties", &mut schema.pattern_properties),
        ("definitions", &mut schema.definitions),
    ] {
        for (name, child) in map.iter_mut().flatten() {
            walk(child, &format!("{path}.{key}.{name}"), visit);
        }
    }
    for (key, list) in [
        ("allOf", &mut schema.all_of),
        ("anyOf", &mut schema.any_of),
        ("oneOf", &mut schema.one_of),
    ] {
        for (i, child) in list.iter_mut().flatten().enumerate() {
            walk(child, &format!("{path}.{key}[{i}]"), visit);
        }
    }
    match &mut schema.items {
        Some(JSONSchemaPropsOrArray::Schema(child)) => {
            walk(child, &format!("{path}.items"), visit);
        }
        Some(JSONSchemaPropsOrArray::Schemas(children)) => {
            for (i, child) in children.iter_mut().enumerate() {
                walk(child, &format!("{path}.items[{i}]"), visit);
            }
        }
        None => {}
    }
    for (key, child) in [
        ("additionalProperties", &mut schema.additional_properties),
        ("additionalItems", &mut schema.additional_items),
    ] {
        if let Some(JSONSchemaPropsOrBool::Schema(child)) = child {
            walk(child, &format!("{path}.{key}"), visit);
        }
    }
    if let Some(child) = &mut schema.not {
        walk(child, &format!("{path}.not"), visit);
    }
    for (name, dependency) in schema.dependencies.iter_mut().flatten() {
        if let JSONSchemaPropsOrStringArray::Schema(child) = dependency {
            walk(child, &format!("{path}.dependencies.{name}"), visit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
        CustomResourceDefinitionSpec, CustomResourceDefinitionVersion, CustomResourceValidation,
    };
    use std::collections::BTreeMap;

    fn crd_with(schema: JSONSchemaProps) -> CustomResourceDefinition {
        CustomResourceDefinition {
            spec: CustomResourceDefinitionSpec {
                versions: vec![CustomResourceDefinitionVersion {
                    name: "v1".to_owned(),
                    schema: Some(CustomResourceValidation {
                        open_api_v3_schema: Some(schema),
                    }),
                    ..CustomResourceDefinitionVersion::default()
                }],
                ..CustomResourceDefinitionSpec::default()
            },
            ..CustomResourceDefinition::default()
        }
    }

    fn typed(type_: &str, format: &str) -> JSONSchemaProps {
        JSONSchemaProps {
            type_: Some(type_.to_owned()),
            format: Some(format.to_owned()),
            ..JSONSchemaProps::default()
        }
    }

    fn object(properties: Vec<(&str, JSONSchemaProps)>) -> JSONSchemaProps {
        JSONSchemaProps {
            type_: Some("object".to_owned()),
            properties: Some(
                properties
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..JSONSchemaProps::default()
        }
    }

    #[test]
    fn an_unknown_format_is_reported_with_its_path() {
        let list = JSONSchemaProps {
            type_: Some("array".to_owned()),
            items: Some(JSONSchemaPropsOrArray::Schema(Box::new(typed(
                "integer", "uint16",
            )))),
            ..JSONSchemaProps::default()
        };
        let crd = crd_with(object(vec![(
            "spec",
            object(vec![
                ("count", typed("integer", "uint8")),
                ("when", typed("string", "date-time")),
                ("size", typed("integer", "int64")),
                ("ratio", typed("number", "float")),
                ("name", typed("string", "k8s-short-name")),
                ("blob", typed("string", "regex")),
                ("flag", typed("boolean", "bool")),
                ("list", list),
            ]),
        )]));
        let found = unknown_formats(&crd);
        let paths: Vec<(&str, &str)> = found
            .iter()
            .map(|f| (f.path.as_str(), f.format.as_str()))
            .collect();
        let base = "spec.versions[v1].schema.openAPIV3Schema.properties.spec.properties";
        assert_eq!(
            paths,
            [
                (format!("{base}.blob").as_str(), "regex"),
                (format!("{base}.count").as_str(), "uint8"),
                (format!("{base}.flag").as_str(), "bool"),
                (format!("{base}.list.items").as_str(), "uint16"),
            ]
        );
        let message = found[1].to_string();
        assert!(message.contains(&format!("{base}.count")), "{message}");
        assert!(message.contains("\"uint8\""), "{message}");
        assert!(message.contains("int32 or int64"), "{message}");
    }

    #[test]
    fn rust_integer_formats_become_kubernetes_ones_keeping_their_range() {
        let bounded = JSONSchemaProps {
            minimum: Some(1.0),
            maximum: Some(100.0),
            ..typed("integer", "uint8")
        };
        let mut crd = crd_with(object(vec![
            ("percent", bounded),
            ("byte", typed("integer", "uint8")),
            ("count", typed("integer", "uint32")),
            ("bytes", typed("integer", "uint64")),
            ("small", typed("integer", "int16")),
            ("fine", typed("integer", "int32")),
        ]));
        kubernetes_formats(&mut crd);
        assert_eq!(unknown_formats(&crd), []);
        let schema = crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap();
        let field = |name: &str| {
            let p = &schema.properties.as_ref().unwrap()[name];
            (p.format.clone().unwrap(), p.minimum, p.maximum)
        };
        assert_eq!(
            field("percent"),
            ("int32".to_owned(), Some(1.0), Some(100.0))
        );
        assert_eq!(field("byte"), ("int32".to_owned(), Some(0.0), Some(255.0)));
        assert_eq!(
            field("count"),
            ("int64".to_owned(), Some(0.0), Some(4_294_967_295.0))
        );
        assert_eq!(field("bytes"), ("int64".to_owned(), Some(0.0), None));
        assert_eq!(
            field("small"),
            ("int32".to_owned(), Some(-32768.0), Some(32767.0))
        );
        assert_eq!(field("fine"), ("int32".to_owned(), None, None));
    }
}
