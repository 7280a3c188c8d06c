//! kerf-api: kerf's Kubernetes-facing types and conversions.
