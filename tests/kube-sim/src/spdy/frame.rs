//! SPDY/3.1 frames: the 8-byte common header, the control frames and DATA, with their
//! size limits. Control frames start with the control bit, the version (3) and a type;
//! data frames with a 31-bit stream id; both then carry 8 bits of flags and a 24-bit
//! payload length.

use bytes::Bytes;

use super::header::{Deflater, HeaderError, Headers, Inflater, MAX_BLOCK};

pub const VERSION: u16 = 3;
/// Length of the common frame header.
pub const HEAD_LEN: usize = 8;
/// Largest DATA payload accepted. Kubernetes clients copy through 32 KiB buffers and write
/// one frame per copy, so this leaves a wide margin while bounding what one frame costs.
pub const MAX_DATA: usize = 256 * 1024;
/// Largest control frame payload accepted: a compressed header block of at most
/// [`MAX_BLOCK`] bytes never needs more, and SETTINGS are bounded below.
pub const MAX_CONTROL: usize = MAX_BLOCK + 64;
/// Most entries accepted in one SETTINGS frame (the draft defines eight ids).
pub const MAX_SETTINGS: usize = 64;

pub const FLAG_FIN: u8 = 0x01;
pub const FLAG_UNIDIRECTIONAL: u8 = 0x02;

pub const SYN_STREAM: u16 = 1;
pub const SYN_REPLY: u16 = 2;
pub const RST_STREAM: u16 = 3;
pub const SETTINGS: u16 = 4;
pub const PING: u16 = 6;
pub const GOAWAY: u16 = 7;
pub const HEADERS: u16 = 8;
pub const WINDOW_UPDATE: u16 = 9;

/// RST_STREAM status codes.
pub mod rst {
    pub const PROTOCOL_ERROR: u32 = 1;
    pub const INVALID_STREAM: u32 = 2;
    pub const REFUSED_STREAM: u32 = 3;
    pub const CANCEL: u32 = 5;
    pub const STREAM_ALREADY_CLOSED: u32 = 9;
}

/// GOAWAY status codes.
pub mod goaway {
    pub const OK: u32 = 0;
    pub const PROTOCOL_ERROR: u32 = 1;
}

/// The common header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    Control {
        version: u16,
        kind: u16,
        flags: u8,
        len: usize,
    },
    Data {
        stream: u32,
        flags: u8,
        len: usize,
    },
}

impl Head {
    pub fn parse(b: [u8; HEAD_LEN]) -> Head {
        let flags = b[4];
        let len = u32::from_be_bytes([0, b[5], b[6], b[7]]) as usize;
        if b[0] & 0x80 != 0 {
            Head::Control {
                version: u16::from_be_bytes([b[0] & 0x7f, b[1]]),
                kind: u16::from_be_bytes([b[2], b[3]]),
                flags,
                len,
            }
        } else {
            Head::Data {
                stream: u32::from_be_bytes([b[0], b[1], b[2], b[3]]) & 0x7fff_ffff,
                flags,
                len,
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Head::Control { len, .. } | Head::Data { len, .. } => *len,
        }
    }

    /// Refuses a payload larger than this kind of frame may have, before it is read.
    pub fn check(&self) -> Result<(), FrameError> {
        let max = match self {
            Head::Control { .. } => MAX_CONTROL,
            Head::Data { .. } => MAX_DATA,
        };
        if self.len() > max {
            return Err(FrameError::TooLarge {
                len: self.len(),
                max,
            });
        }
        Ok(())
    }
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Data {
        stream: u32,
        fin: bool,
        data: Bytes,
    },
    SynStream {
        stream: u32,
        associated: u32,
        priority: u8,
        fin: bool,
        unidirectional: bool,
        headers: Headers,
    },
    SynReply {
        stream: u32,
        fin: bool,
        headers: Headers,
    },
    RstStream {
        stream: u32,
        status: u32,
    },
    Settings {
        clear: bool,
        /// (flags, id, value)
        entries: Vec<(u8, u32, u32)>,
    },
    Ping {
        id: u32,
    },
    GoAway {
        last_good: u32,
        status: u32,
    },
    Headers {
        stream: u32,
        fin: bool,
        headers: Headers,
    },
    WindowUpdate {
        stream: u32,
        delta: u32,
    },
    /// A control frame of a type this implementation does not know: the draft says to
    /// ignore it.
    Unknown {
        kind: u16,
    },
}

/// Why the byte stream cannot be read on: each is a session error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("unsupported SPDY version {0}")]
    Version(u16),
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
    #[error(transparent)]
    Header(#[from] HeaderError),
}

fn u32_at(p: &[u8], at: usize) -> Result<u32, FrameError> {
    p.get(at..at + 4)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or(FrameError::Malformed("control frame too short"))
}

fn stream_at(p: &[u8], at: usize) -> Result<u32, FrameError> {
    let id = u32_at(p, at)? & 0x7fff_ffff;
    if id == 0 {
        return Err(FrameError::Malformed("stream id 0"));
    }
    Ok(id)
}

fn exact(p: &[u8], n: usize) -> Result<(), FrameError> {
    if p.len() != n {
        return Err(FrameError::Malformed("control frame has the wrong length"));
    }
    Ok(())
}

fn block(p: &[u8], at: usize, z: &mut Inflater) -> Result<Headers, FrameError> {
    let compressed = p
        .get(at..)
        .ok_or(FrameError::Malformed("control frame too short"))?;
    let raw = z.decompress(compressed, MAX_BLOCK)?;
    Ok(Headers::decode(&raw)?)
}

/// Decodes a frame whose header is `head` and payload `p` (exactly `head.len()` bytes).
/// Header blocks go through `z`, the connection's inbound context, in arrival order.
pub fn decode(head: Head, p: Bytes, z: &mut Inflater) -> Result<Frame, FrameError> {
    let (version, kind, flags) = match head {
        Head::Data { stream, flags, .. } => {
            if stream == 0 {
                return Err(FrameError::Malformed("data frame on stream 0"));
            }
            return Ok(Frame::Data {
                stream,
                fin: flags & FLAG_FIN != 0,
                data: p,
            });
        }
        Head::Control {
            version,
            kind,
            flags,
            ..
        } => (version, kind, flags),
    };
    if version != VERSION {
        return Err(FrameError::Version(version));
    }
    let fin = flags & FLAG_FIN != 0;
    Ok(match kind {
        SYN_STREAM => {
            let stream = stream_at(&p, 0)?;
            let associated = u32_at(&p, 4)? & 0x7fff_ffff;
            let priority = p
                .get(8)
                .map(|b| b >> 5)
                .ok_or(FrameError::Malformed("control frame too short"))?;
            Frame::SynStream {
                stream,
                associated,
                priority,
                fin,
                unidirectional: flags & FLAG_UNIDIRECTIONAL != 0,
                headers: block(&p, 10, z)?,
            }
        }
        SYN_REPLY => Frame::SynReply {
            stream: stream_at(&p, 0)?,
            fin,
            headers: block(&p, 4, z)?,
        },
        HEADERS => Frame::Headers {
            stream: stream_at(&p, 0)?,
            fin,
            headers: block(&p, 4, z)?,
        },
        RST_STREAM => {
            exact(&p, 8)?;
            let status = u32_at(&p, 4)?;
            if status == 0 {
                return Err(FrameError::Malformed("RST_STREAM with status 0"));
            }
            Frame::RstStream {
                stream: stream_at(&p, 0)?,
                status,
            }
        }
        SETTINGS => {
            let n = u32_at(&p, 0)? as usize;
            if n > MAX_SETTINGS {
                return Err(FrameError::Malformed("too many settings"));
            }
            exact(&p, 4 + 8 * n)?;
            let mut entries = Vec::with_capacity(n);
            for i in 0..n {
                let at = 4 + 8 * i;
                let fid = u32_at(&p, at)?;
                entries.push(((fid >> 24) as u8, fid & 0x00ff_ffff, u32_at(&p, at + 4)?));
            }
            Frame::Settings {
                clear: flags & 0x01 != 0,
                entries,
            }
        }
        PING => {
            exact(&p, 4)?;
            Frame::Ping { id: u32_at(&p, 0)? }
        }
        GOAWAY => {
            exact(&p, 8)?;
            Frame::GoAway {
                last_good: u32_at(&p, 0)? & 0x7fff_ffff,
                status: u32_at(&p, 4)?,
            }
        }
        WINDOW_UPDATE => {
            exact(&p, 8)?;
            let delta = u32_at(&p, 4)? & 0x7fff_ffff;
            if delta == 0 {
                return Err(FrameError::Malformed("WINDOW_UPDATE of 0"));
            }
            Frame::WindowUpdate {
                // Stream 0 is the session's window in SPDY/3.1.
                stream: u32_at(&p, 0)? & 0x7fff_ffff,
                delta,
            }
        }
        other => Frame::Unknown { kind: other },
    })
}

fn control(out: &mut Vec<u8>, kind: u16, flags: u8, payload: &[u8]) {
    let v = VERSION | 0x8000;
    out.extend_from_slice(&v.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    let len = payload.len() as u32;
    out.push(flags);
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.extend_from_slice(payload);
}

/// Appends the wire form of `frame` to `out`; header blocks go through `z`, the
/// connection's outbound context, in sending order. Payloads must respect the 24-bit
/// length (callers split data into chunks well below it).
pub fn encode(frame: &Frame, z: &mut Deflater, out: &mut Vec<u8>) {
    let fin = |f: bool| if f { FLAG_FIN } else { 0 };
    match frame {
        Frame::Data {
            stream,
            fin: f,
            data,
        } => {
            out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
            out.push(fin(*f));
            out.extend_from_slice(&(data.len() as u32).to_be_bytes()[1..]);
            out.extend_from_slice(data);
        }
        Frame::SynStream {
            stream,
            associated,
            priority,
            fin: f,
            unidirectional,
            headers,
        } => {
            let mut p = Vec::new();
            p.extend_from_slice(&stream.to_be_bytes());
            p.extend_from_slice(&associated.to_be_bytes());
            p.push(priority << 5);
            p.push(0);
            p.extend_from_slice(&z.compress(&headers.encode()));
            let flags = fin(*f)
                | if *unidirectional {
                    FLAG_UNIDIRECTIONAL
                } else {
                    0
                };
            control(out, SYN_STREAM, flags, &p);
        }
        Frame::SynReply {
            stream,
            fin: f,
            headers,
        } => {
            let mut p = stream.to_be_bytes().to_vec();
            p.extend_from_slice(&z.compress(&headers.encode()));
            control(out, SYN_REPLY, fin(*f), &p);
        }
        Frame::Headers {
            stream,
            fin: f,
            headers,
        } => {
            let mut p = stream.to_be_bytes().to_vec();
            p.extend_from_slice(&z.compress(&headers.encode()));
            control(out, HEADERS, fin(*f), &p);
        }
        Frame::RstStream { stream, status } => {
            let mut p = stream.to_be_bytes().to_vec();
            p.extend_from_slice(&status.to_be_bytes());
            control(out, RST_STREAM, 0, &p);
        }
        Frame::Settings { clear, entries } => {
            let mut p = (entries.len() as u32).to_be_bytes().to_vec();
            for (flags, id, value) in entries {
                p.extend_from_slice(&(((*flags as u32) << 24) | (id & 0x00ff_ffff)).to_be_bytes());
                p.extend_from_slice(&value.to_be_bytes());
            }
            control(out, SETTINGS, if *clear { 1 } else { 0 }, &p);
        }
        Frame::Ping { id } => control(out, PING, 0, &id.to_be_bytes()),
        Frame::GoAway { last_good, status } => {
            let mut p = last_good.to_be_bytes().to_vec();
            p.extend_from_slice(&status.to_be_bytes());
            control(out, GOAWAY, 0, &p);
        }
        Frame::WindowUpdate { stream, delta } => {
            let mut p = stream.to_be_bytes().to_vec();
            p.extend_from_slice(&delta.to_be_bytes());
            control(out, WINDOW_UPDATE, 0, &p);
        }
        Frame::Unknown { kind } => control(out, *kind, 0, &[]),
    }
}
