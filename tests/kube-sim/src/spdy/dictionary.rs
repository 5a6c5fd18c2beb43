//! The preset dictionary SPDY/3 primes both header compression contexts with (section
//! 2.6.10.1 of the SPDY/3 draft): common header names and values, each written as a 32-bit
//! big-endian length followed by the bytes, then a run of common status lines, dates and
//! media types as plain text.

use std::sync::OnceLock;

/// Words written length-prefixed, in the draft's order.
const WORDS: &[&str] = &[
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];

/// Text appended as is after the words.
const TAIL: &[&str] = &[
    "100101201202205206300302303304305306307",
    "402405406407408409410411412413414415416417",
    "502504505",
    "203 Non-Authoritative Information",
    "204 No Content",
    "301 Moved Permanently",
    "400 Bad Request",
    "401 Unauthorized",
    "403 Forbidden",
    "404 Not Found",
    "500 Internal Server Error",
    "501 Not Implemented",
    "503 Service Unavailable",
    "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec",
    " 00:00:00",
    " Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT",
    "chunked,text/html,image/png,image/jpg,image/gif,application/xml,",
    "application/xhtml+xml,text/plain,text/javascript,public",
    "private",
    "max-age=",
    "gzip,deflate,sdch",
    "charset=utf-8",
    "charset=iso-8859-1,utf-,*,enq=0.",
];

/// The dictionary's bytes, built once.
pub fn bytes() -> &'static [u8] {
    static DICT: OnceLock<Vec<u8>> = OnceLock::new();
    DICT.get_or_init(|| {
        let mut d = Vec::with_capacity(1500);
        for w in WORDS {
            d.extend_from_slice(&(w.len() as u32).to_be_bytes());
            d.extend_from_slice(w.as_bytes());
        }
        for t in TAIL {
            d.extend_from_slice(t.as_bytes());
        }
        d
    })
}
