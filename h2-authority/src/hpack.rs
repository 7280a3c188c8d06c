//! Decoding HPACK header blocks (RFC 7541) with a connection's dynamic table, into one
//! buffer that is reused from block to block.
//!
//! # Why not a decoder crate
//!
//! The adapter decodes every request's header block, so the decoder sits on the hot path of
//! every call the kubelet makes. loona-hpack (and the `hpack` crates it descends from)
//! builds a `HashMap` Huffman table for every Huffman-coded string and walks it bit by bit:
//! measured in `benches/adapter.rs`, that made an h2 round trip four times slower.
//! httlib-hpack's decoder is fast but indexes its input unchecked and panics on a truncated
//! block, which a client can send. h2's own decoder is private. So this module does the
//! part that is specific to HPACK's wire format — prefixed integers, string literals, the
//! five field representations, size updates — and leaves the rest to maintained crates:
//! the static and dynamic tables (with eviction) are httlib-hpack's [`Table`], Huffman
//! decoding is httlib-huffman's table-driven decoder. loona-hpack stays as the oracle of
//! the differential tests.
//!
//! Nothing here indexes its input unchecked: every malformed block is a [`DecodeError`].

use std::ops::Range;

use httlib_hpack::table::Table;
use httlib_huffman::{DecoderSpeed, decode as huffman_decode};

/// Why a header block could not be decoded. The connection's table is then out of step
/// with the client's, and the block must be passed on as received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// The block ends inside a field.
    Truncated,
    /// An integer does not fit the sizes a header block can have.
    IntegerOverflow,
    /// Index 0, or an index past the end of the tables.
    NoSuchIndex(usize),
    /// A Huffman-coded string that is not valid (RFC 7541 §5.2).
    Huffman,
    /// A dynamic table size update above the size the server allows.
    TableSizeTooLarge(usize),
    /// A dynamic table size update after the block's first field (RFC 7541 §4.2).
    LateSizeUpdate,
}

/// The largest integer accepted; a header block is at most [`crate::filter::MAX_HELD_BLOCK`]
/// bytes, so no length or index in one can be larger.
const MAX_INTEGER: usize = 1 << 24;

/// The fields of one decoded header block, in order, as byte ranges of one buffer.
#[derive(Debug, Default)]
pub(crate) struct HeaderList {
    bytes: Vec<u8>,
    fields: Vec<(Range<usize>, Range<usize>)>,
}

impl HeaderList {
    /// Empties the list, keeping its allocations.
    pub(crate) fn clear(&mut self) {
        self.bytes.clear();
        self.fields.clear();
    }

    /// The fields as `(name, value)` pairs.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.fields
            .iter()
            .map(|(name, value)| (&self.bytes[name.clone()], &self.bytes[value.clone()]))
    }

    /// The position of the first field named `name`.
    pub(crate) fn position(&self, name: &[u8]) -> Option<usize> {
        self.iter().position(|(n, _)| n == name)
    }

    /// The value of the field at `index`.
    pub(crate) fn value(&self, index: usize) -> Option<&[u8]> {
        let (_, value) = self.fields.get(index)?;
        self.bytes.get(value.clone())
    }

    fn push_copy(&mut self, name: &[u8], value: &[u8]) {
        let name = self.append(name);
        let value = self.append(value);
        self.fields.push((name, value));
    }

    fn append(&mut self, bytes: &[u8]) -> Range<usize> {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(bytes);
        start..self.bytes.len()
    }
}

/// One connection's decoding state: its dynamic table and the largest size the client may
/// give that table.
pub(crate) struct Decoder {
    table: Table<'static>,
    max_allowed: usize,
}

impl Decoder {
    /// A decoder as at the start of a connection whose server allows `max_allowed` bytes of
    /// dynamic table (SETTINGS_HEADER_TABLE_SIZE).
    pub(crate) fn new(max_allowed: usize) -> Self {
        Decoder {
            table: Table::with_dynamic_size(u32::try_from(max_allowed).unwrap_or(u32::MAX)),
            max_allowed,
        }
    }

    /// Decodes one complete header block into `out` (emptied first), updating the dynamic
    /// table as the client's encoder did.
    ///
    /// # Errors
    /// The block is malformed; see [`DecodeError`]. The table may then be partly updated.
    pub(crate) fn decode(&mut self, block: &[u8], out: &mut HeaderList) -> Result<(), DecodeError> {
        out.clear();
        let mut input = Input { bytes: block };
        while let Some(&first) = input.bytes.first() {
            if first & 0x80 != 0 {
                let index = input.integer(7)?;
                let (name, value) = self.entry(index)?;
                out.push_copy(name, value);
            } else if first & 0x40 != 0 {
                let (name, value) = self.literal(&mut input, 6, out)?;
                let (name, value) = (out.bytes[name].to_vec(), out.bytes[value].to_vec());
                self.table.insert(name, value);
            } else if first & 0x20 != 0 {
                if !out.fields.is_empty() {
                    return Err(DecodeError::LateSizeUpdate);
                }
                let size = input.integer(5)?;
                if size > self.max_allowed {
                    return Err(DecodeError::TableSizeTooLarge(size));
                }
                // `size` is at most `max_allowed`, which came from a u32.
                self.table
                    .update_max_dynamic_size(u32::try_from(size).unwrap_or(u32::MAX));
            } else {
                // Without indexing (0000) or never indexed (0001): the table is untouched.
                self.literal(&mut input, 4, out)?;
            }
        }
        Ok(())
    }

    /// A field from the tables.
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), DecodeError> {
        u32::try_from(index)
            .ok()
            .and_then(|i| self.table.get(i))
            .ok_or(DecodeError::NoSuchIndex(index))
    }

    /// A literal field whose name is indexed (index > 0) or follows as a string; appends it
    /// to `out` and returns the ranges of its name and value there.
    fn literal(
        &self,
        input: &mut Input<'_>,
        prefix: u8,
        out: &mut HeaderList,
    ) -> Result<(Range<usize>, Range<usize>), DecodeError> {
        let index = input.integer(prefix)?;
        let name = if index == 0 {
            input.string(&mut out.bytes)?
        } else {
            let (name, _) = self.entry(index)?;
            out.append(name)
        };
        let value = input.string(&mut out.bytes)?;
        out.fields.push((name.clone(), value.clone()));
        Ok((name, value))
    }
}

/// The unread rest of a header block.
struct Input<'a> {
    bytes: &'a [u8],
}

impl Input<'_> {
    /// A prefixed integer (RFC 7541 §5.1) whose first octet keeps its low `prefix` bits.
    fn integer(&mut self, prefix: u8) -> Result<usize, DecodeError> {
        let (&first, mut rest) = self.bytes.split_first().ok_or(DecodeError::Truncated)?;
        let max_prefix = (1usize << prefix) - 1;
        let mut value = usize::from(first) & max_prefix;
        if value == max_prefix {
            let mut shift = 0u32;
            loop {
                let (&octet, tail) = rest.split_first().ok_or(DecodeError::Truncated)?;
                rest = tail;
                value += usize::from(octet & 0x7f) << shift;
                if value > MAX_INTEGER {
                    return Err(DecodeError::IntegerOverflow);
                }
                if octet & 0x80 == 0 {
                    break;
                }
                shift += 7;
                if shift > 28 {
                    return Err(DecodeError::IntegerOverflow);
                }
            }
        }
        self.bytes = rest;
        Ok(value)
    }

    /// A string literal (RFC 7541 §5.2), appended to `bytes` decoded; returns its range.
    fn string(&mut self, bytes: &mut Vec<u8>) -> Result<Range<usize>, DecodeError> {
        let huffman = self.bytes.first().is_some_and(|&b| b & 0x80 != 0);
        let len = self.integer(7)?;
        if len > self.bytes.len() {
            return Err(DecodeError::Truncated);
        }
        let (raw, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        let start = bytes.len();
        if huffman {
            if huffman_decode(raw, bytes, DecoderSpeed::FourBits).is_err() {
                bytes.truncate(start);
                return Err(DecodeError::Huffman);
            }
        } else {
            bytes.extend_from_slice(raw);
        }
        Ok(start..bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Fields = Vec<(Vec<u8>, Vec<u8>)>;

    fn decode(decoder: &mut Decoder, block: &[u8]) -> Result<Fields, DecodeError> {
        let mut list = HeaderList::default();
        decoder.decode(block, &mut list)?;
        Ok(list.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect())
    }

    fn fields(pairs: &[(&str, &str)]) -> Fields {
        pairs
            .iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The first two requests of RFC 7541 Appendix C.3 and C.4.
    const C_FIRST: [(&str, &str); 4] = [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/"),
        (":authority", "www.example.com"),
    ];
    const C_SECOND: [(&str, &str); 5] = [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/"),
        (":authority", "www.example.com"),
        ("cache-control", "no-cache"),
    ];

    /// RFC 7541 Appendix C.3: three requests without Huffman coding on one connection.
    #[test]
    fn rfc_7541_c3_requests_without_huffman() {
        let mut decoder = Decoder::new(4096);
        assert_eq!(
            decode(
                &mut decoder,
                &hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d")
            ),
            Ok(fields(&C_FIRST))
        );
        assert_eq!(
            decode(&mut decoder, &hex("8286 84be 5808 6e6f 2d63 6163 6865")),
            Ok(fields(&C_SECOND))
        );
        assert_eq!(
            decode(
                &mut decoder,
                &hex("8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65")
            ),
            Ok(fields(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ]))
        );
    }

    /// RFC 7541 Appendix C.4: the same requests with Huffman coding.
    #[test]
    fn rfc_7541_c4_requests_with_huffman() {
        let mut decoder = Decoder::new(4096);
        assert_eq!(
            decode(
                &mut decoder,
                &hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff")
            ),
            Ok(fields(&C_FIRST))
        );
        assert_eq!(
            decode(&mut decoder, &hex("8286 84be 5886 a8eb 1064 9cbf")),
            Ok(fields(&C_SECOND))
        );
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let mut decoder = Decoder::new(4096);
        assert_eq!(
            decode(&mut decoder, &[0x80]),
            Err(DecodeError::NoSuchIndex(0))
        );
        assert_eq!(
            decode(&mut decoder, &[0xff, 0x00]),
            Err(DecodeError::NoSuchIndex(127))
        );
        assert_eq!(
            decode(&mut decoder, &[0x41, 0x05, b'a']),
            Err(DecodeError::Truncated)
        );
        assert_eq!(decode(&mut decoder, &[0x7f]), Err(DecodeError::Truncated));
        assert_eq!(
            decode(&mut decoder, &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]),
            Err(DecodeError::IntegerOverflow)
        );
        assert_eq!(
            decode(&mut decoder, &[0x3f, 0xe2, 0x1f]),
            Err(DecodeError::TableSizeTooLarge(4097))
        );
        assert_eq!(
            decode(&mut decoder, &[0x82, 0x20]),
            Err(DecodeError::LateSizeUpdate)
        );
        // A Huffman string of all ones is the EOS symbol's prefix run too long.
        assert_eq!(
            decode(&mut decoder, &[0x01, 0x84, 0xff, 0xff, 0xff, 0xff]),
            Err(DecodeError::Huffman)
        );
    }

    #[test]
    fn a_size_update_evicts_and_bounds_later_inserts() {
        let mut decoder = Decoder::new(4096);
        let block = hex("4003 6b65 7905 7661 6c75 65"); // key: value, indexed
        decode(&mut decoder, &block).unwrap();
        assert_eq!(
            decode(&mut decoder, &[0xbe]),
            Ok(fields(&[("key", "value")]))
        );
        assert_eq!(
            decode(&mut decoder, &[0x20, 0x82]),
            Ok(fields(&[(":method", "GET")]))
        );
        assert_eq!(
            decode(&mut decoder, &[0xbe]),
            Err(DecodeError::NoSuchIndex(62))
        );
    }

    mod differential {
        use proptest::prelude::*;

        use super::*;

        fn header() -> impl Strategy<Value = (Vec<u8>, Vec<u8>)> {
            (
                prop_oneof![
                    Just(b":authority".to_vec()),
                    Just(b":path".to_vec()),
                    Just(b"te".to_vec()),
                    proptest::collection::vec(b'a'..=b'z', 1..12),
                ],
                proptest::collection::vec(any::<u8>(), 0..40),
            )
        }

        proptest! {
            /// Blocks encoded by two other encoders (with indexing, Huffman or not) decode
            /// as loona-hpack's decoder decodes them, block after block on one connection.
            #[test]
            fn decodes_as_loona_does(
                blocks in proptest::collection::vec(proptest::collection::vec(header(), 0..8), 1..6),
                flags in 0u8..4,
            ) {
                let mut ours = Decoder::new(4096);
                let mut oracle = loona_hpack::Decoder::new();
                let mut loona = loona_hpack::Encoder::new();
                let mut httlib = httlib_hpack::Encoder::default();
                for (n, block) in blocks.iter().enumerate() {
                    let encoded = if n % 2 == 0 || flags & 1 == 0 {
                        loona.encode(block.iter().map(|(a, b)| (&a[..], &b[..])))
                    } else {
                        let mut out = Vec::new();
                        for (name, value) in block {
                            let mut f = httlib_hpack::Encoder::WITH_INDEXING | httlib_hpack::Encoder::BEST_FORMAT;
                            if flags & 2 != 0 {
                                f |= httlib_hpack::Encoder::HUFFMAN_NAME | httlib_hpack::Encoder::HUFFMAN_VALUE;
                            }
                            httlib.encode((name.clone(), value.clone(), f), &mut out).unwrap();
                        }
                        out
                    };
                    let expected = oracle.decode(&encoded).unwrap();
                    prop_assert_eq!(decode(&mut ours, &encoded), Ok(expected));
                }
            }

            /// Whatever a client sends is an answer or an error, never a panic.
            #[test]
            fn arbitrary_bytes_never_panic(
                blocks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..4),
            ) {
                let mut decoder = Decoder::new(4096);
                for block in &blocks {
                    let _ = decode(&mut decoder, block);
                }
            }
        }
    }
}
