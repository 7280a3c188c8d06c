//! The server-side adapter in front of a real h2 server, driven by raw client frames: every
//! HPACK representation a client may choose for `:authority`, header blocks across
//! CONTINUATION frames and larger than a frame, and many streams on one connection.
//!
//! The byte layouts follow what grpc-go writes (`internal/transport/http2_client.go`,
//! `createHeaderFields`: `:method`, `:scheme`, `:path`, `:authority`, `content-type`,
//! `user-agent`, `te`; encoded by `golang.org/x/net/http2/hpack` `Encoder.WriteField`: a
//! field found whole in the tables is indexed, any other is a literal with incremental
//! indexing, its name indexed when known, strings Huffman-coded when shorter).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use httlib_hpack::Encoder;
use kerf_h2_authority::AuthorityForm;
use proptest::prelude::*;
use support::{
    BlockEncoder, CONTINUATION, END_HEADERS, END_STREAM, HEADERS, Outcome, PADDED, PRIORITY,
    connection_start, empty_message, field, frame, grpc_request, outcomes, seen, serve,
};
use tokio::io::AsyncWriteExt as _;

const SOCKET: &[u8] = b"/var/lib/kubelet/plugins_registry/gpu.kerf.dev-reg.sock";
const PERCENT: &[u8] = b"%2Fvar%2Flib%2Fkubelet%2Fplugins%2Fgpu.kerf.dev%2Fdra.sock";

/// How grpc-go writes every field: indexed when found whole, else a literal with
/// incremental indexing, Huffman-coded.
const GO: u8 =
    Encoder::BEST_FORMAT | Encoder::WITH_INDEXING | Encoder::HUFFMAN_NAME | Encoder::HUFFMAN_VALUE;
/// A plain literal without indexing, name indexed when known.
const PLAIN: u8 = Encoder::BEST_FORMAT;
/// Protocol error code of RST_STREAM.
const PROTOCOL_ERROR: u32 = 0x1;

fn headers(stream: u32, block: &[u8]) -> Vec<u8> {
    frame(HEADERS, END_HEADERS, stream, block)
}

fn request(stream: u32, block: &[u8]) -> Vec<u8> {
    let mut out = headers(stream, block);
    out.extend(empty_message(stream));
    out
}

async fn send_and_collect(
    lenient: bool,
    bytes: &[u8],
    streams: &[u32],
) -> std::collections::HashMap<u32, Outcome> {
    let (mut client, _log) = serve(lenient);
    client.write_all(bytes).await.unwrap();
    outcomes(&mut client, streams).await
}

#[tokio::test]
async fn without_the_adapter_h2_resets_a_path_authority() {
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    bytes.extend(request(
        1,
        &encoder.encode(&grpc_request(Some((SOCKET, GO)), GO)),
    ));
    let results = send_and_collect(false, &bytes, &[1]).await;
    assert_eq!(results.get(&1), Some(&Outcome::Reset(PROTOCOL_ERROR)));
}

#[tokio::test]
async fn an_indexed_path_authority_is_answered_and_later_referred_to_by_dynamic_index() {
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    let first = encoder.encode(&grpc_request(Some((SOCKET, GO)), GO));
    // The :authority field is a literal with incremental indexing of static name 1 (0x41)
    // with a Huffman-coded value (high bit of the length byte).
    let at = first
        .iter()
        .position(|&b| b == 0x40 | 0x01)
        .expect("indexed-name literal");
    assert_ne!(first[at + 1] & 0x80, 0, "Huffman-coded value");
    let second = encoder.encode(&grpc_request(Some((SOCKET, GO)), GO));
    // Every field of the second request, :authority included, is a dynamic-table index.
    assert!(second.iter().all(|b| b & 0x80 != 0), "{second:x?}");
    bytes.extend(request(1, &first));
    bytes.extend(request(3, &second));
    let results = send_and_collect(true, &bytes, &[1, 3]).await;
    assert_eq!(seen(results.get(&1)).as_deref(), Some("localhost"));
    assert_eq!(seen(results.get(&3)).as_deref(), Some("localhost"));
}

#[tokio::test]
async fn plain_and_never_indexed_literals_are_answered() {
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    bytes.extend(request(
        1,
        &encoder.encode(&grpc_request(Some((PERCENT, PLAIN)), PLAIN)),
    ));
    let never = PLAIN | Encoder::NEVER_INDEXED;
    bytes.extend(request(
        3,
        &encoder.encode(&grpc_request(Some((SOCKET, never)), never)),
    ));
    // A literal name (not the static index) with a Huffman-coded name and value.
    let literal_name = Encoder::HUFFMAN_NAME | Encoder::HUFFMAN_VALUE;
    bytes.extend(request(
        5,
        &encoder.encode(&grpc_request(Some((SOCKET, literal_name)), PLAIN)),
    ));
    let results = send_and_collect(true, &bytes, &[1, 3, 5]).await;
    for stream in [1, 3, 5] {
        assert_eq!(
            seen(results.get(&stream)).as_deref(),
            Some("localhost"),
            "stream {stream}"
        );
    }
}

#[tokio::test]
async fn every_form_is_answered_and_valid_ones_pass_unchanged() {
    let forms: [(Option<&[u8]>, &str); 6] = [
        (Some(SOCKET), "localhost"),
        (Some(PERCENT), "localhost"),
        (Some(b""), "localhost"),
        (Some(b"localhost"), "localhost"),
        (Some(b"kubelet.example:8080"), "kubelet.example:8080"),
        (None, ""),
    ];
    let (mut client, log) = serve(true);
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    let mut streams = Vec::new();
    for (i, (authority, _)) in forms.iter().enumerate() {
        let stream = 2 * u32::try_from(i).unwrap() + 1;
        streams.push(stream);
        bytes.extend(request(
            stream,
            &encoder.encode(&grpc_request(authority.map(|a| (a, GO)), GO)),
        ));
    }
    client.write_all(&bytes).await.unwrap();
    let results = outcomes(&mut client, &streams).await;
    for (stream, (authority, expected)) in streams.iter().zip(forms) {
        assert_eq!(
            seen(results.get(stream)).as_deref(),
            Some(expected),
            "{authority:?}"
        );
    }
    for form in [
        AuthorityForm::SocketPath,
        AuthorityForm::PercentEncodedPath,
        AuthorityForm::Empty,
        AuthorityForm::Host,
        AuthorityForm::Absent,
    ] {
        assert!(log.has_seen(form), "{form:?} not logged");
    }
}

#[tokio::test]
async fn a_block_across_continuations_with_padding_and_priority() {
    let mut encoder = BlockEncoder::default();
    let block = encoder.encode(&grpc_request(Some((SOCKET, GO)), GO));
    let (a, rest) = block.split_at(5);
    let (b, c) = rest.split_at(rest.len() / 2);
    let mut first = vec![4]; // pad length
    first.extend([0x80, 0, 0, 0, 42]); // exclusive dependency on nothing, weight 42
    first.extend(a);
    first.extend([0; 4]);
    let mut bytes = connection_start();
    bytes.extend(frame(HEADERS, PADDED | PRIORITY, 1, &first));
    bytes.extend(frame(CONTINUATION, 0, 1, b));
    bytes.extend(frame(CONTINUATION, END_HEADERS, 1, c));
    bytes.extend(empty_message(1));
    let results = send_and_collect(true, &bytes, &[1]).await;
    assert_eq!(seen(results.get(&1)).as_deref(), Some("localhost"));
}

#[tokio::test]
async fn a_block_larger_than_a_frame_is_carried_whole() {
    // A 40 KiB header value, Huffman-coded by the client so that the re-encoded (plain)
    // block is larger still: both sides need CONTINUATION frames.
    let big = "b".repeat(40 * 1024);
    let mut fields = grpc_request(Some((SOCKET, GO)), GO);
    fields.push(field("x-big", &big, Encoder::HUFFMAN_VALUE));
    let block = BlockEncoder::default().encode(&fields);
    let mut bytes = connection_start();
    let chunks: Vec<&[u8]> = block.chunks(16_384).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        let flags = if last { END_HEADERS } else { 0 };
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        bytes.extend(frame(kind, flags, 1, chunk));
    }
    bytes.extend(empty_message(1));
    let results = send_and_collect(true, &bytes, &[1]).await;
    let Some(Outcome::Answered(response)) = results.get(&1) else {
        panic!("not answered: {results:?}");
    };
    assert_eq!(response[support::SEEN], "localhost");
    assert_eq!(response[support::BIG_LEN], big.len().to_string());
}

#[tokio::test]
async fn many_concurrent_streams_with_mixed_forms() {
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    let streams: Vec<u32> = (0..100).map(|i| 2 * i + 1).collect();
    // Every request opens its stream first; the messages follow in reverse order.
    for &stream in &streams {
        let authority: &[u8] = match stream % 3 {
            0 => SOCKET,
            1 => b"localhost",
            _ => PERCENT,
        };
        bytes.extend(headers(
            stream,
            &encoder.encode(&grpc_request(Some((authority, GO)), GO)),
        ));
    }
    for &stream in streams.iter().rev() {
        bytes.extend(empty_message(stream));
    }
    let results = send_and_collect(true, &bytes, &streams).await;
    for stream in streams {
        assert_eq!(
            seen(results.get(&stream)).as_deref(),
            Some("localhost"),
            "stream {stream}"
        );
    }
}

#[tokio::test]
async fn a_size_update_from_the_client_is_honoured() {
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    bytes.extend(request(
        1,
        &encoder.encode(&grpc_request(Some((SOCKET, GO)), GO)),
    ));
    // The client shrinks its table to nothing, then indexes again from scratch.
    let mut fresh = BlockEncoder::default();
    let mut second = vec![0x20]; // dynamic table size update to 0
    second.extend(fresh.encode(&grpc_request(Some((PERCENT, GO)), GO)));
    bytes.extend(request(3, &second));
    let results = send_and_collect(true, &bytes, &[1, 3]).await;
    assert_eq!(seen(results.get(&1)).as_deref(), Some("localhost"));
    assert_eq!(seen(results.get(&3)).as_deref(), Some("localhost"));
}

#[tokio::test]
async fn a_bad_index_is_refused_by_the_server_as_without_the_adapter() {
    let mut bytes = connection_start();
    // Index 70 refers to a dynamic entry that does not exist.
    bytes.extend(request(1, &[0x80 | 0x46]));
    let without = send_and_collect(false, &bytes, &[1]).await;
    let with = send_and_collect(true, &bytes, &[1]).await;
    assert!(
        matches!(without.get(&0), Some(Outcome::GoAway(_))),
        "{without:?}"
    );
    assert_eq!(with, without);
}

fn conversation() -> (Vec<u8>, Vec<u32>) {
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    let mut streams = Vec::new();
    for i in 0..6u32 {
        let stream = 2 * i + 1;
        streams.push(stream);
        let authority: &[u8] = if i % 2 == 0 { SOCKET } else { b"localhost" };
        bytes.extend(request(
            stream,
            &encoder.encode(&grpc_request(Some((authority, GO)), GO)),
        ));
    }
    (bytes, streams)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// However the client's writes are cut, every request is answered.
    #[test]
    fn any_write_boundaries(cuts in proptest::collection::vec(1usize..64, 1..40)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (bytes, streams) = conversation();
        let results = runtime.block_on(async {
            let (mut client, _log) = serve(true);
            let mut rest = &bytes[..];
            for cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (piece, after) = rest.split_at((*cut).min(rest.len()));
                client.write_all(piece).await.unwrap();
                client.flush().await.unwrap();
                tokio::task::yield_now().await;
                rest = after;
            }
            outcomes(&mut client, &streams).await
        });
        for stream in streams {
            let authority = seen(results.get(&stream));
            prop_assert_eq!(authority.as_deref(), Some("localhost"));
        }
    }
}

#[test]
fn end_stream_on_headers_is_kept() {
    // A request without a body: END_STREAM on the HEADERS frame must survive the rewrite.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    bytes.extend(frame(
        HEADERS,
        END_HEADERS | END_STREAM,
        1,
        &encoder.encode(&grpc_request(Some((SOCKET, GO)), GO)),
    ));
    let results = runtime.block_on(send_and_collect(true, &bytes, &[1]));
    assert_eq!(seen(results.get(&1)).as_deref(), Some("localhost"));
}

/// Reads everything the server would read through the adapter from `bytes`.
async fn through_adapter(bytes: &[u8]) -> Vec<u8> {
    use tokio::io::AsyncReadExt as _;
    let (mut client, server) = tokio::io::duplex(1 << 20);
    client.write_all(bytes).await.unwrap();
    client.shutdown().await.unwrap();
    let mut adapted = kerf_h2_authority::LenientAuthority::new(
        server,
        kerf_h2_authority::AuthorityLog::new("test"),
    );
    let mut out = Vec::new();
    adapted.read_to_end(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn valid_authorities_pass_byte_for_byte() {
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    for (stream, authority) in [
        (1, Some(&b"localhost"[..])),
        (3, None),
        (5, Some(b"localhost")),
    ] {
        bytes.extend(request(
            stream,
            &encoder.encode(&grpc_request(authority.map(|a| (a, GO)), GO)),
        ));
    }
    assert_eq!(through_adapter(&bytes).await, bytes);
}

#[tokio::test]
async fn after_the_first_rewrite_the_server_table_is_emptied_and_never_filled() {
    let mut encoder = BlockEncoder::default();
    let mut bytes = connection_start();
    let authorities: [&[u8]; 4] = [b"localhost", SOCKET, b"localhost", SOCKET];
    for (i, authority) in authorities.iter().enumerate() {
        let stream = 2 * u32::try_from(i).unwrap() + 1;
        bytes.extend(headers(
            stream,
            &encoder.encode(&grpc_request(Some((authority, GO)), GO)),
        ));
    }
    let out = through_adapter(&bytes).await;
    // Decode what the server receives as h2 would, frame by frame.
    let mut server = loona_hpack::Decoder::new();
    let mut rest = &out[connection_start().len()..];
    let mut blocks = Vec::new();
    while !rest.is_empty() {
        let len = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
        blocks.push(rest[9..9 + len].to_vec());
        rest = &rest[9 + len..];
    }
    assert_eq!(blocks.len(), 4);
    // The first block is the client's own; the second starts with a size update to zero.
    assert_eq!(blocks[1][0], 0x20);
    for (block, authority) in blocks.iter().zip(authorities) {
        let fields = server.decode(block).unwrap();
        let expected: &[u8] = if authority == SOCKET {
            b"localhost"
        } else {
            authority
        };
        let got = fields
            .iter()
            .find(|(n, _)| n == b":authority")
            .map(|(_, v)| v.as_slice());
        assert_eq!(got, Some(expected));
        assert_eq!(fields.len(), 7, "no field lost or added");
    }
    // The server's dynamic table is empty: nothing re-encoded was added to it.
    assert!(server.decode(&[0x80 | 0x3e]).is_err());
}

/// The first HEADERS frame grpcio 1.85.1 (grpc-c 58.0.0) sent on a fresh connection to
/// `unix:/tmp/kerf-capture/s/cap-unset.sock` with `grpc.default_authority` unset, captured
/// byte for byte: `:authority` = `tmp%2Fkerf-capture%2Fs%2Fcap-unset.sock`, a literal with
/// incremental indexing and a literal name, no Huffman.
const GRPCIO_UNSET_FIRST: &str = "00011001040000000140053a70617468282f706c7567696e726567697374726174696f6e2e526567697374726174696f6e2f476574496e666f400a3a617574686f7269747927746d702532466b6572662d63617074757265253246732532466361702d756e7365742e736f636b8386400c636f6e74656e742d74797065106170706c69636174696f6e2f677270634002746508747261696c6572734014677270632d6163636570742d656e636f64696e67176964656e746974792c206465666c6174652c20677a6970400c677270632d74696d656f7574043639336d400a757365722d6167656e7430677270632d707974686f6e2f312e38352e3120677270632d632f35382e302e3020286c696e75783b2063687474703229";
/// The same with `grpc.default_authority` = the socket path.
const GRPCIO_PATH_FIRST: &str = "00010a01040000000140053a70617468282f706c7567696e726567697374726174696f6e2e526567697374726174696f6e2f476574496e666f400a3a617574686f72697479212f746d702f6b6572662d636170747572652f732f6361702d706174682e736f636b8386400c636f6e74656e742d74797065106170706c69636174696f6e2f677270634002746508747261696c6572734014677270632d6163636570742d656e636f64696e67176964656e746974792c206465666c6174652c20677a6970400c677270632d74696d656f7574043639336d400a757365722d6167656e7430677270632d707974686f6e2f312e38352e3120677270632d632f35382e302e3020286c696e75783b2063687474703229";
/// The second request's HEADERS frame on that connection (the same in every
/// configuration): `:authority` is dynamic index 68 (`c4`).
const GRPCIO_SECOND: &str = "00005b01040000000340053a70617468392f706c7567696e726567697374726174696f6e2e526567697374726174696f6e2f4e6f74696679526567697374726174696f6e537461747573c48386c3c2c1400c677270632d74696d656f7574043730316dc0";

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test]
async fn the_bytes_grpcio_sends_are_answered() {
    for first in [GRPCIO_UNSET_FIRST, GRPCIO_PATH_FIRST] {
        let mut bytes = connection_start();
        bytes.extend(unhex(first));
        bytes.extend(empty_message(1));
        bytes.extend(unhex(GRPCIO_SECOND));
        bytes.extend(empty_message(3));
        let without = send_and_collect(false, &bytes, &[1, 3]).await;
        assert_eq!(without.get(&1), Some(&Outcome::Reset(PROTOCOL_ERROR)));
        let with = send_and_collect(true, &bytes, &[1, 3]).await;
        assert_eq!(seen(with.get(&1)).as_deref(), Some("localhost"));
        assert_eq!(seen(with.get(&3)).as_deref(), Some("localhost"));
    }
}
