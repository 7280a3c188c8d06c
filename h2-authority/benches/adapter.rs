//! What the `:authority` adapter costs an HTTP/2 conversation, measured against the same
//! conversation without it in the same run.
//!
//! Each iteration sends a batch of gRPC-shaped requests (the kubelet's header fields, a
//! 5-byte message, `te: trailers`) concurrently on one established h2 connection over an
//! in-memory pipe and waits for every answer. The server is h2's, as under tonic.
//!
//! - `floor`: no adapter; the client sends `localhost`.
//! - `lenient_localhost`: the server reads through [`LenientAuthority`]; the client sends
//!   `localhost` (the kubelet's DRA calls: every header block passes unchanged).
//! - `lenient_socket_path`: the client sends the socket path (the kubelet's registration
//!   calls: every header block is re-encoded). The client side of this case runs through
//!   [`WithAuthority`], so it also carries that adapter's cost.
//!
//! Compare each case's median to `floor` at the same batch size.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A benchmark that cannot set up has nothing to measure.

use bytes::Bytes;
use divan::Bencher;
use kerf_h2_authority::{AuthorityLog, LenientAuthority, SendAuthority, WithAuthority};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::runtime::Runtime;

fn main() {
    divan::main();
}

/// Concurrent requests per iteration: one call, and the width of `kerf-bench prepare-parallel`.
const BATCHES: [usize; 2] = [1, 64];
const SOCKET: &str = "/var/lib/kubelet/plugins_registry/gpu.kerf.dev-reg.sock";
const PIPE: usize = 256 * 1024;

#[derive(Clone, Copy)]
enum Case {
    Floor,
    LenientLocalhost,
    LenientSocketPath,
}

struct Conversation {
    runtime: Runtime,
    client: h2::client::SendRequest<Bytes>,
}

impl Conversation {
    fn start(case: Case) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = runtime.block_on(async move {
            let (client_io, server_io) = tokio::io::duplex(PIPE);
            match case {
                Case::Floor => {
                    tokio::spawn(answer(server_io));
                }
                Case::LenientLocalhost | Case::LenientSocketPath => {
                    let log = AuthorityLog::new(SOCKET);
                    tokio::spawn(answer(LenientAuthority::new(server_io, log)));
                }
            }
            match case {
                Case::Floor | Case::LenientLocalhost => handshake(client_io).await,
                Case::LenientSocketPath => {
                    let send = SendAuthority::Value(SOCKET.as_bytes().to_vec());
                    handshake(WithAuthority::new(client_io, send)).await
                }
            }
        });
        Conversation { runtime, client }
    }

    fn calls(&self, batch: usize) {
        self.runtime.block_on(async {
            let mut answers = Vec::with_capacity(batch);
            for _ in 0..batch {
                let mut client = self.client.clone().ready().await.unwrap();
                let (answer, mut body) = client.send_request(request(), false).unwrap();
                body.send_data(Bytes::from_static(b"\0\0\0\0\0"), true)
                    .unwrap();
                answers.push(answer);
            }
            for answer in answers {
                let mut body = answer.await.unwrap().into_body();
                while let Some(chunk) = body.data().await {
                    let chunk = chunk.unwrap();
                    body.flow_control().release_capacity(chunk.len()).unwrap();
                }
            }
        });
    }
}

async fn handshake<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: T,
) -> h2::client::SendRequest<Bytes> {
    let (client, connection) = h2::client::handshake(io).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

fn request() -> http::Request<()> {
    http::Request::post(
        "http://localhost/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
    )
    .header("content-type", "application/grpc")
    .header("user-agent", "grpc-go/1.72.2")
    .header("te", "trailers")
    .body(())
    .unwrap()
}

/// Answers every request with a 5-byte message and `grpc-status: 0` trailers, as a tonic
/// unary answer does.
async fn answer<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(io: T) {
    let Ok(mut connection) = h2::server::handshake(io).await else {
        return;
    };
    while let Some(Ok((request, mut respond))) = connection.accept().await {
        tokio::spawn(async move {
            let mut body = request.into_body();
            while let Some(Ok(chunk)) = body.data().await {
                let _ = body.flow_control().release_capacity(chunk.len());
            }
            let head = http::Response::builder()
                .header("content-type", "application/grpc")
                .body(())
                .unwrap();
            let Ok(mut send) = respond.send_response(head, false) else {
                return;
            };
            let _ = send.send_data(Bytes::from_static(b"\0\0\0\0\0"), false);
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let _ = send.send_trailers(trailers);
        });
    }
}

fn run(bencher: Bencher, case: Case, batch: usize) {
    let conversation = Conversation::start(case);
    conversation.calls(batch); // warm the HPACK tables and the connection's windows
    bencher.bench_local(|| conversation.calls(batch));
}

#[divan::bench(args = BATCHES)]
fn floor(bencher: Bencher, batch: usize) {
    run(bencher, Case::Floor, batch);
}

#[divan::bench(args = BATCHES)]
fn lenient_localhost(bencher: Bencher, batch: usize) {
    run(bencher, Case::LenientLocalhost, batch);
}

#[divan::bench(args = BATCHES)]
fn lenient_socket_path(bencher: Bencher, batch: usize) {
    run(bencher, Case::LenientSocketPath, batch);
}
