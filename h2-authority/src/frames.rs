//! The few HTTP/2 framing facts the adapters need (RFC 9113 §3.4, §4.1, §6.2, §6.10).

use bytes::{BufMut as _, BytesMut};

/// The client connection preface (RFC 9113 §3.4).
pub(crate) const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Length of a frame header.
pub(crate) const HEADER_LEN: usize = 9;

/// Frame type HEADERS.
pub(crate) const HEADERS: u8 = 0x1;
/// Frame type CONTINUATION.
pub(crate) const CONTINUATION: u8 = 0x9;

/// HEADERS flag: the last frame the sender sends on this stream.
pub(crate) const END_STREAM: u8 = 0x1;
/// HEADERS / CONTINUATION flag: the header block ends in this frame.
pub(crate) const END_HEADERS: u8 = 0x4;
/// HEADERS flag: a pad length byte leads the payload and padding follows the fragment.
pub(crate) const PADDED: u8 = 0x8;
/// HEADERS flag: five bytes of priority fields follow the pad length.
pub(crate) const PRIORITY: u8 = 0x20;

/// Length of a HEADERS frame's priority fields (exclusive bit + stream dependency, weight).
pub(crate) const PRIORITY_LEN: usize = 5;

/// The largest frame payload every peer accepts: SETTINGS_MAX_FRAME_SIZE is never below
/// 2^14 (RFC 9113 §4.2), so frames of at most this size need no knowledge of the peer's
/// settings.
pub(crate) const SAFE_PAYLOAD: usize = 16_384;

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    /// Payload length.
    pub len: usize,
    /// Frame type.
    pub kind: u8,
    /// Flags.
    pub flags: u8,
    /// Stream identifier (the reserved bit cleared).
    pub stream_id: u32,
}

impl FrameHeader {
    /// Reads a frame header from the first [`HEADER_LEN`] bytes of `bytes`, which the caller
    /// guarantees are there.
    pub(crate) fn parse(bytes: &[u8; HEADER_LEN]) -> Self {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        let stream_id = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]) & 0x7fff_ffff;
        FrameHeader {
            len,
            kind: bytes[3],
            flags: bytes[4],
            stream_id,
        }
    }

    /// Appends this header to `out`.
    pub(crate) fn write(self, out: &mut BytesMut) {
        debug_assert!(self.len < 1 << 24, "frame lengths are 24 bits");
        let len = u32::try_from(self.len).unwrap_or(u32::MAX).to_be_bytes();
        out.put_slice(&len[1..]);
        out.put_u8(self.kind);
        out.put_u8(self.flags);
        out.put_u32(self.stream_id & 0x7fff_ffff);
    }
}

/// Where a HEADERS frame's header block fragment lies within its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeadersPayload<'a> {
    /// The priority fields, when the PRIORITY flag is set.
    pub priority: Option<[u8; PRIORITY_LEN]>,
    /// The header block fragment, padding removed.
    pub fragment: &'a [u8],
}

/// Splits a HEADERS frame's payload into priority fields and fragment.
///
/// Returns `None` when the padding or priority fields do not fit the payload: the receiver
/// treats that as a connection error (RFC 9113 §6.2), so the caller passes the frame on
/// untouched and lets the server say so.
pub(crate) fn headers_payload(flags: u8, payload: &[u8]) -> Option<HeadersPayload<'_>> {
    let (pad, mut rest) = if flags & PADDED == 0 {
        (0, payload)
    } else {
        let (&pad, rest) = payload.split_first()?;
        (usize::from(pad), rest)
    };
    let priority = if flags & PRIORITY == 0 {
        None
    } else {
        let (fields, after) = rest.split_at_checked(PRIORITY_LEN)?;
        rest = after;
        Some(<[u8; PRIORITY_LEN]>::try_from(fields).ok()?)
    };
    let fragment_len = rest.len().checked_sub(pad)?;
    Some(HeadersPayload {
        priority,
        fragment: &rest[..fragment_len],
    })
}

/// Appends a header block as one HEADERS frame and as many CONTINUATION frames as needed,
/// none with a payload over [`SAFE_PAYLOAD`], no padding.
pub(crate) fn write_header_block(
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; PRIORITY_LEN]>,
    block: &[u8],
    out: &mut BytesMut,
) {
    let priority_len = if priority.is_some() { PRIORITY_LEN } else { 0 };
    let first_len = block.len().min(SAFE_PAYLOAD - priority_len);
    let (first, mut rest) = block.split_at(first_len);
    out.reserve(block.len() + priority_len + HEADER_LEN * (2 + block.len() / SAFE_PAYLOAD));
    let mut flags = 0;
    if end_stream {
        flags |= END_STREAM;
    }
    if priority.is_some() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    FrameHeader {
        len: priority_len + first.len(),
        kind: HEADERS,
        flags,
        stream_id,
    }
    .write(out);
    if let Some(fields) = priority {
        out.put_slice(&fields);
    }
    out.put_slice(first);
    while !rest.is_empty() {
        let (chunk, after) = rest.split_at(rest.len().min(SAFE_PAYLOAD));
        rest = after;
        FrameHeader {
            len: chunk.len(),
            kind: CONTINUATION,
            flags: if rest.is_empty() { END_HEADERS } else { 0 },
            stream_id,
        }
        .write(out);
        out.put_slice(chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_header_round_trip() {
        let header = FrameHeader {
            len: 0x01_02_03,
            kind: HEADERS,
            flags: END_HEADERS | END_STREAM,
            stream_id: 0x7fff_fffe,
        };
        let mut out = BytesMut::new();
        header.write(&mut out);
        let bytes: [u8; HEADER_LEN] = out[..].try_into().unwrap();
        assert_eq!(FrameHeader::parse(&bytes), header);
    }

    #[test]
    fn the_reserved_bit_is_ignored() {
        let bytes = [0, 0, 0, HEADERS, 0, 0x80, 0, 0, 3];
        assert_eq!(FrameHeader::parse(&bytes).stream_id, 3);
    }

    #[test]
    fn padding_and_priority_are_stripped() {
        let payload = [2, 0x80, 0, 0, 1, 15, b'a', b'b', 0, 0];
        let parsed = headers_payload(PADDED | PRIORITY, &payload).unwrap();
        assert_eq!(parsed.priority, Some([0x80, 0, 0, 1, 15]));
        assert_eq!(parsed.fragment, b"ab");
        assert_eq!(headers_payload(0, b"xyz").unwrap().fragment, b"xyz");
    }

    #[test]
    fn impossible_padding_is_refused() {
        assert!(headers_payload(PADDED, &[5, 1, 2]).is_none());
        assert!(headers_payload(PADDED, &[]).is_none());
        assert!(headers_payload(PRIORITY, &[1, 2, 3]).is_none());
    }

    #[test]
    fn a_large_block_is_split_into_continuations() {
        let block = vec![7u8; SAFE_PAYLOAD * 2 + 10];
        let mut out = BytesMut::new();
        write_header_block(5, true, Some([0, 0, 0, 3, 200]), &block, &mut out);
        let mut frames = Vec::new();
        let mut rest = &out[..];
        while !rest.is_empty() {
            let header = FrameHeader::parse(rest[..HEADER_LEN].try_into().unwrap());
            frames.push(header);
            assert!(header.len <= SAFE_PAYLOAD);
            rest = &rest[HEADER_LEN + header.len..];
        }
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0].kind, HEADERS);
        assert_eq!(frames[0].flags, END_STREAM | PRIORITY);
        assert_eq!(frames[1].kind, CONTINUATION);
        assert_eq!(frames[1].flags, 0);
        assert_eq!(frames[2].flags, END_HEADERS);
        let carried: usize = frames.iter().map(|f| f.len).sum();
        assert_eq!(carried, block.len() + PRIORITY_LEN);
    }
}
