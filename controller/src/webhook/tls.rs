//! The webhook's serving certificate: issued by a CA of its own (self-signed mode) or read
//! from PEM files (cert-manager mode), and swapped in the running server through
//! [`CertResolver`] without closing the listener.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::ServerConfig;
use rustls::crypto::ring::sign::any_supported_type;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::error::{Error, Result};

/// How far back a new certificate's validity starts, for API servers whose clock is behind.
const CLOCK_SKEW: Duration = Duration::from_secs(300);

/// A CA and the serving certificate it signed, as [`issue`] makes them.
#[derive(Clone)]
pub struct Issued {
    /// The CA certificate in PEM: what goes into the webhook configuration's `caBundle`.
    pub ca_pem: String,
    /// The serving certificate and its key, ready for rustls.
    pub key: Arc<CertifiedKey>,
    /// When the serving certificate (and its CA) expire.
    pub not_after: SystemTime,
}

impl fmt::Debug for Issued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issued")
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

/// The DNS names the API server may use for `service` in `namespace`; it dials
/// `<service>.<namespace>.svc`.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
        format!("{service}.{namespace}"),
        service.to_owned(),
    ]
}

/// Issues a fresh CA and a serving certificate for `dns_names`, both valid from a few minutes
/// ago until `validity` from now. Each call makes a new CA key: nothing secret is kept on disk
/// or in the cluster.
///
/// # Errors
///
/// [`Error::Tls`] when a key or certificate cannot be made (e.g. an invalid DNS name).
pub fn issue(dns_names: &[String], validity: Duration) -> Result<Issued> {
    let tls = |what: &'static str| move |e: rcgen::Error| Error::Tls(format!("{what}: {e}"));
    let now = SystemTime::now();
    let not_before = time::OffsetDateTime::from(now - CLOCK_SKEW);
    let not_after_system = now + validity;
    let not_after = time::OffsetDateTime::from(not_after_system);

    let ca_key = KeyPair::generate().map_err(tls("generating the CA key"))?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "kerf-controller webhook CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_before = not_before;
    ca.not_after = not_after;
    let ca_cert = ca
        .self_signed(&ca_key)
        .map_err(tls("signing the CA certificate"))?;

    let key = KeyPair::generate().map_err(tls("generating the serving key"))?;
    let mut serving =
        CertificateParams::new(dns_names.to_vec()).map_err(tls("serving certificate names"))?;
    serving.distinguished_name = rcgen::DistinguishedName::new();
    if let Some(first) = dns_names.first() {
        serving
            .distinguished_name
            .push(DnType::CommonName, first.as_str());
    }
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    serving.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    serving.use_authority_key_identifier_extension = true;
    serving.not_before = not_before;
    serving.not_after = not_after;
    let issuer = Issuer::from_params(&ca, &ca_key);
    let cert = serving
        .signed_by(&key, &issuer)
        .map_err(tls("signing the serving certificate"))?;

    let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let signer = any_supported_type(&private)
        .map_err(|e| Error::Tls(format!("loading the serving key: {e}")))?;
    Ok(Issued {
        ca_pem: ca_cert.pem(),
        key: Arc::new(CertifiedKey::new(vec![cert.der().clone()], signer)),
        not_after: not_after_system,
    })
}

/// Reads a certificate chain (`tls.crt`) and its key (`tls.key`) in PEM, as cert-manager
/// writes them into a Secret.
///
/// # Errors
///
/// [`Error::CertFile`] when a file cannot be read or holds no usable certificate or key.
pub fn load_files(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>> {
    let bad = |path: &Path, message: String| Error::CertFile {
        path: path.to_owned(),
        message,
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad(cert, e.to_string()))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(bad(cert, "no PEM certificate in the file".to_owned()));
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, e.to_string()))?;
    let signer = any_supported_type(&private).map_err(|e| bad(key, e.to_string()))?;
    Ok(Arc::new(CertifiedKey::new(chain, signer)))
}

/// The paths of `tls.crt` and `tls.key` in `dir`.
pub fn file_paths(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("tls.crt"), dir.join("tls.key"))
}

/// Serves whichever certificate was stored last; clones of the `Arc` share it.
pub struct CertResolver {
    current: RwLock<Arc<CertifiedKey>>,
}

impl fmt::Debug for CertResolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertResolver").finish_non_exhaustive()
    }
}

impl CertResolver {
    /// A resolver serving `key`.
    pub fn new(key: Arc<CertifiedKey>) -> Arc<Self> {
        Arc::new(Self {
            current: RwLock::new(key),
        })
    }

    /// Serves `key` from the next TLS handshake on; connections already open keep theirs.
    pub fn swap(&self, key: Arc<CertifiedKey>) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = key;
    }

    /// The certificate served now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A rustls server configuration (ring, TLS 1.2 and 1.3, HTTP/1.1) that takes its certificate
/// from `resolver` at every handshake.
///
/// # Errors
///
/// [`Error::Tls`] when rustls refuses the protocol versions (it does not with ring).
pub fn server_config(resolver: Arc<CertResolver>) -> Result<Arc<ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issues_a_ca_and_a_serving_certificate_for_the_service() {
        let names = service_names("kerf-webhook", "kerf-system");
        assert_eq!(names[0], "kerf-webhook.kerf-system.svc");
        let issued = issue(&names, Duration::from_secs(3600)).unwrap();
        assert!(issued.ca_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert_eq!(issued.key.cert.len(), 1);
        let left = issued.not_after.duration_since(SystemTime::now()).unwrap();
        assert!(left <= Duration::from_secs(3600) && left > Duration::from_secs(3500));
        let again = issue(&names, Duration::from_secs(3600)).unwrap();
        assert_ne!(again.ca_pem, issued.ca_pem, "every issue makes a new CA");
    }

    #[test]
    fn files_that_are_missing_or_empty_are_errors() {
        let dir = std::env::temp_dir().join(format!("kerf-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = file_paths(&dir);
        assert!(load_files(&cert, &key).is_err());
        std::fs::write(&cert, "nothing").unwrap();
        std::fs::write(&key, "nothing").unwrap();
        let err = load_files(&cert, &key).unwrap_err();
        assert!(err.to_string().contains("tls.crt"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
