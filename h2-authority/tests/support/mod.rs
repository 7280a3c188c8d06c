//! A raw HTTP/2 client that writes frames byte for byte as a test describes them, and an h2
//! server that answers each request with the `:authority` it saw.

#![allow(
    dead_code,
    clippy::missing_panics_doc,
    clippy::unwrap_used,
    clippy::expect_used
)]

use std::collections::HashMap;
use std::sync::Arc;

use bytes::{BufMut as _, Bytes, BytesMut};
use httlib_hpack::{Encoder, EncoderInput};
use kerf_h2_authority::{AuthorityLog, LenientAuthority};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, DuplexStream};

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const GOAWAY: u8 = 0x7;
pub const CONTINUATION: u8 = 0x9;
pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const PADDED: u8 = 0x8;
pub const PRIORITY: u8 = 0x20;
pub const ACK: u8 = 0x1;

/// The response header in which the test server echoes the `:authority` it saw.
pub const SEEN: &str = "x-seen-authority";
/// The response header in which it echoes the length of the request's `x-big` header.
pub const BIG_LEN: &str = "x-big-len";

/// One frame.
pub fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = BytesMut::new();
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    out.put_slice(&len[1..]);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream_id);
    out.put_slice(payload);
    out.to_vec()
}

/// One header field and the HPACK representation to write it in (httlib-hpack flags:
/// `Encoder::WITH_INDEXING`, `NEVER_INDEXED`, `HUFFMAN_NAME`, `HUFFMAN_VALUE`, `BEST_FORMAT`).
pub struct Field {
    pub name: &'static str,
    pub value: Vec<u8>,
    pub flags: u8,
}

pub fn field(name: &'static str, value: impl AsRef<[u8]>, flags: u8) -> Field {
    Field {
        name,
        value: value.as_ref().to_vec(),
        flags,
    }
}

/// The request fields of a gRPC call as grpc-go orders them, with `:authority` in the
/// given representation (`None`: no `:authority`).
pub fn grpc_request(authority: Option<(&[u8], u8)>, flags: u8) -> Vec<Field> {
    let mut fields = vec![
        field(":method", "POST", flags),
        field(":scheme", "http", flags),
        field(":path", "/pluginregistration.Registration/GetInfo", flags),
    ];
    if let Some((value, authority_flags)) = authority {
        fields.push(field(":authority", value, authority_flags));
    }
    fields.push(field("content-type", "application/grpc", flags));
    fields.push(field("user-agent", "grpc-go/1.72.2", flags));
    fields.push(field("te", "trailers", flags));
    fields
}

/// A client-side HPACK encoder whose every field's representation the test chooses.
pub struct BlockEncoder {
    encoder: Encoder<'static>,
}

impl Default for BlockEncoder {
    fn default() -> Self {
        BlockEncoder {
            encoder: Encoder::with_dynamic_size(4096),
        }
    }
}

impl BlockEncoder {
    pub fn encode(&mut self, fields: &[Field]) -> Vec<u8> {
        let mut block = Vec::new();
        for f in fields {
            let input = EncoderInput::Literal(f.name.as_bytes().to_vec(), f.value.clone(), f.flags);
            self.encoder.encode(input, &mut block).unwrap();
        }
        block
    }

    /// Encodes one field with a name taken from the static table by index.
    pub fn encode_indexed_name(&mut self, index: u32, value: &[u8], flags: u8) -> Vec<u8> {
        let mut block = Vec::new();
        self.encoder
            .encode(
                EncoderInput::IndexedName(index, value.to_vec(), flags),
                &mut block,
            )
            .unwrap();
        block
    }
}

/// A gRPC message frame with an empty message.
pub fn empty_message(stream_id: u32) -> Vec<u8> {
    frame(DATA, END_STREAM, stream_id, &[0, 0, 0, 0, 0])
}

/// The start of a client connection: preface and an empty SETTINGS frame.
pub fn connection_start() -> Vec<u8> {
    let mut out = PREFACE.to_vec();
    out.extend(frame(SETTINGS, 0, 0, &[]));
    out
}

/// What happened to one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Response headers, decoded.
    Answered(HashMap<String, String>),
    /// RST_STREAM with this error code.
    Reset(u32),
    /// GOAWAY with this error code (recorded for stream 0).
    GoAway(u32),
}

/// Reads server frames until every stream in `streams` has an outcome or the connection
/// ends (GOAWAY, EOF). Acknowledges the server's SETTINGS.
pub async fn outcomes<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    streams: &[u32],
) -> HashMap<u32, Outcome> {
    let mut decoder = loona_hpack::Decoder::new();
    let mut results = HashMap::new();
    let mut buf = BytesMut::new();
    while streams.iter().any(|s| !results.contains_key(s)) {
        while buf.len() < 9 || buf.len() < 9 + frame_len(&buf) {
            if io.read_buf(&mut buf).await.unwrap() == 0 {
                return results;
            }
        }
        let len = frame_len(&buf);
        let frame = buf.split_to(9 + len);
        let (kind, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[9..];
        match kind {
            SETTINGS if flags & ACK == 0 => {
                // The server may have closed already; its GOAWAY tells why.
                let _ = io.write_all(&self::frame(SETTINGS, ACK, 0, &[])).await;
            }
            HEADERS => {
                assert_ne!(flags & END_HEADERS, 0, "the test server sends small blocks");
                let headers = decoder.decode(payload).unwrap();
                let map = headers
                    .into_iter()
                    .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                    .collect();
                results.entry(stream).or_insert(Outcome::Answered(map));
            }
            RST_STREAM => {
                let code = u32::from_be_bytes(payload[..4].try_into().unwrap());
                results.entry(stream).or_insert(Outcome::Reset(code));
            }
            GOAWAY => {
                let code = u32::from_be_bytes(payload[4..8].try_into().unwrap());
                results.insert(0, Outcome::GoAway(code));
                return results;
            }
            _ => {}
        }
    }
    results
}

fn frame_len(buf: &[u8]) -> usize {
    if buf.len() < 3 {
        return 0;
    }
    usize::from(buf[0]) << 16 | usize::from(buf[1]) << 8 | usize::from(buf[2])
}

/// The authority a response echoes, `None` for a reset stream.
pub fn seen(outcome: Option<&Outcome>) -> Option<String> {
    match outcome {
        Some(Outcome::Answered(headers)) => headers.get(SEEN).cloned(),
        _ => None,
    }
}

/// Starts an h2 server on one end of an in-memory pipe, behind the adapter when `lenient`,
/// and returns the other end and the socket's authority log.
pub fn serve(lenient: bool) -> (DuplexStream, Arc<AuthorityLog>) {
    let (client, server) = tokio::io::duplex(1 << 20);
    let log = AuthorityLog::new("test");
    let server_log = Arc::clone(&log);
    tokio::spawn(async move {
        if lenient {
            answer(LenientAuthority::new(server, server_log)).await;
        } else {
            answer(server).await;
        }
    });
    (client, log)
}

/// Serves requests on `io`: each is answered 200 with the `:authority` it had in
/// [`SEEN`] (empty for none) and its `x-big` header's length in [`BIG_LEN`].
pub async fn answer<T: AsyncRead + AsyncWrite + Unpin + Send + 'static>(io: T) {
    let Ok(mut connection) = h2::server::handshake(io).await else {
        return;
    };
    while let Some(Ok((request, mut respond))) = connection.accept().await {
        let authority = request
            .uri()
            .authority()
            .map(ToString::to_string)
            .unwrap_or_default();
        let big = request
            .headers()
            .get("x-big")
            .map_or(0, http::HeaderValue::len);
        let response = http::Response::builder()
            .status(200)
            .header(SEEN, authority)
            .header(BIG_LEN, big.to_string())
            .body(())
            .unwrap();
        let _ = respond.send_response(response, true);
    }
}

/// A Bytes of `n` copies of `b`.
pub fn repeat(b: u8, n: usize) -> Bytes {
    Bytes::from(vec![b; n])
}
