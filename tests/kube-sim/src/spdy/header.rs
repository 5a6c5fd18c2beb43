//! Name/value header blocks: the uncompressed layout (a 32-bit pair count, then per pair a
//! 32-bit length and the name, a 32-bit length and the value; several values of one name
//! joined by NUL) and the zlib contexts that compress them. Each direction of a connection
//! has one context for its whole life, primed with the SPDY/3 dictionary and flushed with
//! a sync flush after every block, so the peer can decode each block as it arrives.

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

use super::dictionary;

/// Largest header block accepted after decompression.
pub const MAX_BLOCK: usize = 64 * 1024;
/// Most name/value pairs accepted in one block.
pub const MAX_PAIRS: usize = 256;

/// Why a header block was refused. Every one of these is a session error: the shared
/// decompression context can no longer be trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("header block larger than {MAX_BLOCK} bytes after decompression")]
    TooLarge,
    #[error("header block is not a valid zlib stream: {0}")]
    Corrupt(String),
    #[error("header block compressed with an unknown dictionary (id {0:#x})")]
    WrongDictionary(u32),
    #[error("malformed header block: {0}")]
    Malformed(&'static str),
}

/// Headers of a stream, names lowercase, in the order received; a name sent with several
/// NUL-separated values appears once per value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(pub Vec<(String, String)>);

impl Headers {
    pub fn new() -> Self {
        Self::default()
    }

    #[cfg(test)]
    pub fn with(mut self, name: &str, value: &str) -> Self {
        self.0.push((name.to_ascii_lowercase(), value.to_string()));
        self
    }

    /// The first value of `name` (case-insensitive).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The uncompressed block: values of one name are joined with NUL, in first-seen order.
    pub fn encode(&self) -> Vec<u8> {
        let mut names: Vec<&str> = Vec::new();
        for (n, _) in &self.0 {
            if !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
        let mut out = Vec::new();
        out.extend_from_slice(&(names.len() as u32).to_be_bytes());
        for name in names {
            let value = self
                .0
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
                .collect::<Vec<_>>()
                .join("\0");
            out.extend_from_slice(&(name.len() as u32).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out
    }

    /// Parses an uncompressed block. Names must be non-empty, lowercase and not repeated;
    /// names and values must be UTF-8 (every header Kubernetes sends is ASCII).
    pub fn decode(block: &[u8]) -> Result<Headers, HeaderError> {
        let mut r = Cursor { buf: block, pos: 0 };
        let count = r.u32()? as usize;
        if count > MAX_PAIRS {
            return Err(HeaderError::Malformed("too many name/value pairs"));
        }
        let mut out = Headers::new();
        let mut seen: Vec<String> = Vec::with_capacity(count);
        for _ in 0..count {
            let name = r.string()?;
            if name.is_empty() {
                return Err(HeaderError::Malformed("empty header name"));
            }
            if name.bytes().any(|b| b.is_ascii_uppercase()) {
                return Err(HeaderError::Malformed("header name not lowercase"));
            }
            if seen.contains(&name) {
                return Err(HeaderError::Malformed("header name repeated"));
            }
            let value = r.string()?;
            for v in value.split('\0') {
                out.0.push((name.clone(), v.to_string()));
            }
            seen.push(name);
        }
        if r.pos != block.len() {
            return Err(HeaderError::Malformed("bytes after the last pair"));
        }
        Ok(out)
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn u32(&mut self) -> Result<u32, HeaderError> {
        let b = self
            .buf
            .get(self.pos..self.pos + 4)
            .ok_or(HeaderError::Malformed("truncated length"))?;
        self.pos += 4;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn string(&mut self) -> Result<String, HeaderError> {
        let len = self.u32()? as usize;
        let end = self
            .pos
            .checked_add(len)
            .filter(|e| *e <= self.buf.len())
            .ok_or(HeaderError::Malformed("length past the end of the block"))?;
        let s = std::str::from_utf8(&self.buf[self.pos..end])
            .map_err(|_| HeaderError::Malformed("header not UTF-8"))?;
        self.pos = end;
        Ok(s.to_string())
    }
}

/// The compressing side of one direction.
pub struct Deflater {
    z: Compress,
}

impl std::fmt::Debug for Deflater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Deflater")
    }
}

impl Default for Deflater {
    fn default() -> Self {
        Self::new()
    }
}

impl Deflater {
    pub fn new() -> Self {
        let mut z = Compress::new(Compression::default(), true);
        // Only fails for a stream already in use; this one is fresh.
        let _ = z.set_dictionary(dictionary::bytes());
        Self { z }
    }

    /// Compresses one block and sync-flushes it.
    pub fn compress(&mut self, block: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(block.len() / 2 + 64);
        let start_in = self.z.total_in();
        // Each round consumes input or fills spare room; a block of n bytes needs far fewer
        // rounds than this bound.
        for _ in 0..(block.len() / 64 + 64) {
            let done = (self.z.total_in() - start_in) as usize;
            if out.capacity() - out.len() < 64 {
                out.reserve(block.len().max(256));
            }
            let r = self
                .z
                .compress_vec(&block[done..], &mut out, FlushCompress::Sync);
            let consumed = (self.z.total_in() - start_in) as usize;
            // Finished when all input is in and the flush left spare room behind it.
            if r.is_err() || (consumed == block.len() && out.len() < out.capacity()) {
                break;
            }
        }
        out
    }
}

/// The decompressing side of one direction.
pub struct Inflater {
    z: Decompress,
}

impl std::fmt::Debug for Inflater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Inflater")
    }
}

impl Default for Inflater {
    fn default() -> Self {
        Self::new()
    }
}

impl Inflater {
    pub fn new() -> Self {
        Self {
            z: Decompress::new(true),
        }
    }

    /// Decompresses one block (the compressed bytes of one frame), refusing more than
    /// `max` bytes of output.
    pub fn decompress(&mut self, input: &[u8], max: usize) -> Result<Vec<u8>, HeaderError> {
        let mut out: Vec<u8> = Vec::new();
        let start_in = self.z.total_in();
        // Every round either consumes input, produces output (at most `max` + 1 bytes in
        // steps of at least 1 KiB) or stops; the bound only guards against a stuck stream.
        for _ in 0..(input.len() + max / 1024 + 16) {
            let done = (self.z.total_in() - start_in) as usize;
            if out.len() == out.capacity() {
                let room = (max + 1 - out.len()).min(16 * 1024);
                if room == 0 {
                    return Err(HeaderError::TooLarge);
                }
                out.reserve_exact(room);
            }
            let before_out = out.len();
            match self
                .z
                .decompress_vec(&input[done..], &mut out, FlushDecompress::Sync)
            {
                Ok(Status::StreamEnd) => {
                    return Err(HeaderError::Corrupt("zlib stream ended".into()));
                }
                Ok(_) => {}
                Err(e) => match e.needs_dictionary() {
                    Some(id) => {
                        let want = adler32(dictionary::bytes());
                        if id != want {
                            return Err(HeaderError::WrongDictionary(id));
                        }
                        self.z
                            .set_dictionary(dictionary::bytes())
                            .map_err(|e| HeaderError::Corrupt(e.to_string()))?;
                        continue;
                    }
                    None => return Err(HeaderError::Corrupt(e.to_string())),
                },
            }
            if out.len() > max {
                return Err(HeaderError::TooLarge);
            }
            let consumed = (self.z.total_in() - start_in) as usize;
            let progressed = consumed > done || out.len() > before_out;
            if consumed == input.len() && out.len() < out.capacity() {
                return Ok(out);
            }
            if !progressed && out.len() < out.capacity() {
                return Err(HeaderError::Corrupt("truncated header block".into()));
            }
        }
        Err(HeaderError::Corrupt("header block did not finish".into()))
    }
}

/// Adler-32 (RFC 1950), the id a zlib stream names its preset dictionary by.
pub fn adler32(data: &[u8]) -> u32 {
    const MOD: u32 = 65521;
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in data.chunks(5552) {
        for &x in chunk {
            a += x as u32;
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    (b << 16) | a
}
