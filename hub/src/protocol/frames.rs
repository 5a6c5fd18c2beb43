//! Length-prefixed message envelopes, sans IO. gRPC, gRPC-Web and Connect
//! streaming all use the same shape: one flags byte, a big-endian `u32`
//! length, the payload.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Bytes before each payload.
pub const PREFIX_LEN: usize = 5;

/// gRPC and Connect: the payload is compressed.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Connect streaming: the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;
/// gRPC-Web: the trailers frame.
pub const FLAG_TRAILERS: u8 = 0x80;

/// One envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

/// A payload over the limit, said before buffering it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooLarge {
    pub len: usize,
    pub max: usize,
}

/// Splits a byte stream into envelopes.
#[derive(Debug)]
pub struct Parser {
    buf: BytesMut,
    max: usize,
}

impl Parser {
    pub fn new(max: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            max,
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole envelope, if one is buffered.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, TooLarge> {
        if self.buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max {
            return Err(TooLarge { len, max: self.max });
        }
        if self.buf.len() < PREFIX_LEN + len {
            return Ok(None);
        }
        let flags = self.buf[0];
        self.buf.advance(PREFIX_LEN);
        Ok(Some(Envelope {
            flags,
            payload: self.buf.split_to(len).freeze(),
        }))
    }

    /// Bytes left that do not make a whole envelope.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }
}

/// Encodes one envelope.
pub fn encode(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(PREFIX_LEN + payload.len());
    out.put_u8(flags);
    out.put_u32(payload.len() as u32);
    out.extend_from_slice(payload);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_across_pushes_and_bounds_length() {
        let mut p = Parser::new(8);
        let e = encode(0, b"abc");
        p.push(&e[..4]);
        assert_eq!(p.next_envelope().unwrap(), None);
        p.push(&e[4..]);
        assert_eq!(
            p.next_envelope().unwrap(),
            Some(Envelope {
                flags: 0,
                payload: Bytes::from_static(b"abc")
            })
        );
        p.push(&[0, 0, 0, 0, 9]);
        assert_eq!(p.next_envelope(), Err(TooLarge { len: 9, max: 8 }));
    }
}
