//! The client-side adapter under a real h2 client: what it puts on the wire, and that a
//! server refuses it without the server-side adapter and answers it with it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use kerf_h2_authority::{SendAuthority, WithAuthority};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite};

const SOCKET: &[u8] = b"/var/lib/kubelet/plugins_registry/gpu.kerf.dev-reg.sock";

/// A GetInfo request head, as a gRPC client sends it (body-less: only headers matter here).
fn get_info() -> http::Request<()> {
    http::Request::post("http://localhost/pluginregistration.Registration/GetInfo")
        .header("content-type", "application/grpc")
        .body(())
        .unwrap()
}

/// Sends two requests from an h2 client over `io`; returns the responses' echoed authority,
/// or the error text.
async fn two_requests<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: T,
) -> Vec<Result<String, String>> {
    let (client, connection) = h2::client::handshake(io).await.unwrap();
    tokio::spawn(connection);
    let mut results = Vec::new();
    for _ in 0..2 {
        let mut client = client.clone().ready().await.unwrap();
        let (response, _) = client.send_request(get_info(), true).unwrap();
        results.push(match response.await {
            Ok(r) => Ok(r.headers()[support::SEEN].to_str().unwrap().to_owned()),
            Err(e) => Err(e.to_string()),
        });
    }
    results
}

#[tokio::test]
async fn a_path_authority_is_refused_by_h2_alone_and_answered_through_the_server_adapter() {
    let (pipe, _log) = support::serve(false);
    let refused = two_requests(WithAuthority::new(
        pipe,
        SendAuthority::Value(SOCKET.to_vec()),
    ))
    .await;
    for result in refused {
        let error = result.unwrap_err();
        assert!(
            error.contains("PROTOCOL_ERROR") || error.contains("protocol error"),
            "{error}"
        );
    }
    let (pipe, _log) = support::serve(true);
    let answered = two_requests(WithAuthority::new(
        pipe,
        SendAuthority::Value(SOCKET.to_vec()),
    ))
    .await;
    assert_eq!(
        answered,
        vec![Ok("localhost".to_owned()), Ok("localhost".to_owned())]
    );
    let (pipe, _log) = support::serve(true);
    let absent = two_requests(WithAuthority::new(pipe, SendAuthority::Absent)).await;
    assert_eq!(absent, vec![Ok(String::new()), Ok(String::new())]);
}

/// Sends two requests without waiting for answers, and keeps the connection open.
async fn two_unanswered_requests<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(io: T) {
    let (client, connection) = h2::client::handshake(io).await.unwrap();
    tokio::spawn(connection);
    let mut pending = Vec::new();
    for _ in 0..2 {
        let mut client = client.clone().ready().await.unwrap();
        pending.push(client.send_request(get_info(), true).unwrap());
    }
    std::future::pending::<()>().await;
}

#[tokio::test]
async fn on_the_wire_the_authority_is_indexed_once_then_referred_to() {
    let (client_end, mut server_end) = tokio::io::duplex(1 << 20);
    let sender = tokio::spawn(two_unanswered_requests(WithAuthority::new(
        client_end,
        SendAuthority::Value(SOCKET.to_vec()),
    )));
    // Play a minimal server: read the preface and frames, answer nothing, and decode the
    // header blocks the client sent.
    let mut wire = Vec::new();
    let mut blocks = Vec::new();
    let mut buf = [0u8; 4096];
    while blocks.len() < 2 {
        let n = server_end.read(&mut buf).await.unwrap();
        assert_ne!(n, 0, "client closed early");
        wire.extend_from_slice(&buf[..n]);
        blocks = header_blocks(&wire);
    }
    sender.abort();
    let mut decoder = loona_hpack::Decoder::new();
    for block in &blocks {
        let fields = decoder.decode(block).unwrap();
        let authority = fields
            .iter()
            .find(|(n, _)| n == b":authority")
            .map(|(_, v)| v.clone());
        assert_eq!(authority.as_deref(), Some(SOCKET));
    }
    // As grpc-go: a literal with incremental indexing of static name 1, Huffman-coded, and
    // on the second request an index into the dynamic table.
    let first_authority = blocks[0]
        .iter()
        .position(|&b| b == 0x41)
        .expect("indexed literal");
    assert_ne!(blocks[0][first_authority + 1] & 0x80, 0, "Huffman-coded");
    assert!(blocks[1].iter().all(|b| b & 0x80 != 0), "{:x?}", blocks[1]);
}

/// The HEADERS payloads (no padding or priority: h2 sends none) in `wire` after the preface.
fn header_blocks(wire: &[u8]) -> Vec<Vec<u8>> {
    let mut rest = &wire[support::PREFACE.len().min(wire.len())..];
    let mut blocks = Vec::new();
    while rest.len() >= 9 {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        if rest.len() < 9 + len {
            break;
        }
        if rest[3] == support::HEADERS {
            blocks.push(rest[9..9 + len].to_vec());
        }
        rest = &rest[9 + len..];
    }
    blocks
}
