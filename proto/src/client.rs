//! The kubelet's side of the plugin sockets, as far as every caller needs it alike: dialling
//! a Unix socket and judging a plugin's registration answer.

use crate::pluginregistration::PluginInfo;
use crate::service_names::DRA_PLUGIN_TYPE;

/// Judges a DRA plugin's `GetInfo` answer as the kubelet does: the type must be `DRAPlugin`,
/// the endpoint an absolute path, and one of the plugin's `supported_versions` known; the
/// kubelet walks the plugin's list (newest first) and takes the first it knows.
///
/// # Errors
/// The reason the kubelet would refuse the registration, in its words.
pub fn choose_dra_service<'a>(info: &'a PluginInfo, known: &[&str]) -> Result<&'a str, String> {
    if info.r#type != DRA_PLUGIN_TYPE {
        return Err(format!(
            "plugin type {:?} is not {DRA_PLUGIN_TYPE}",
            info.r#type
        ));
    }
    if !info.endpoint.starts_with('/') {
        return Err(format!(
            "endpoint {:?} is not an absolute path",
            info.endpoint
        ));
    }
    info.supported_versions
        .iter()
        .map(String::as_str)
        .find(|v| known.contains(v))
        .ok_or_else(|| {
            format!(
                "none of the plugin's versions {:?} is supported",
                info.supported_versions
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service_names::{DRA_V1, DRA_V1BETA1};

    fn info(kind: &str, endpoint: &str, versions: &[&str]) -> PluginInfo {
        PluginInfo {
            r#type: kind.into(),
            name: "gpu.kerf.dev".into(),
            endpoint: endpoint.into(),
            supported_versions: versions.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn picks_the_plugins_first_known_service() {
        let both = info("DRAPlugin", "/x/dra.sock", &[DRA_V1, DRA_V1BETA1]);
        assert_eq!(
            choose_dra_service(&both, &[DRA_V1BETA1, DRA_V1]),
            Ok(DRA_V1)
        );
        assert_eq!(choose_dra_service(&both, &[DRA_V1BETA1]), Ok(DRA_V1BETA1));
        let future = info("DRAPlugin", "/x/dra.sock", &["v9.DRAPlugin", DRA_V1BETA1]);
        assert_eq!(
            choose_dra_service(&future, &[DRA_V1, DRA_V1BETA1]),
            Ok(DRA_V1BETA1)
        );
    }

    #[test]
    fn refuses_what_the_kubelet_refuses() {
        assert!(
            choose_dra_service(&info("CSIPlugin", "/x", &[DRA_V1]), &[DRA_V1])
                .unwrap_err()
                .contains("CSIPlugin")
        );
        assert!(
            choose_dra_service(&info("DRAPlugin", "x.sock", &[DRA_V1]), &[DRA_V1])
                .unwrap_err()
                .contains("absolute")
        );
        assert!(
            choose_dra_service(&info("DRAPlugin", "/x", &[]), &[DRA_V1])
                .unwrap_err()
                .contains("supported")
        );
    }
}
