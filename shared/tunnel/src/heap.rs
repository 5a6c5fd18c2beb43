//! How the binaries' heap gives memory back to the kernel.
//!
//! glibc's malloc returns the free top of its heap to the kernel as soon as
//! more than 128 KiB of it is free, and the next burst faults those pages in
//! again. A bulk stream (a port-forward, a large List, a Watch that
//! saturates the tunnel) frees and allocates that much many times a
//! second: page faults were 7 % of the receiving side's CPU, and tunnel
//! throughput over loopback rose by a quarter to a half for every
//! transport once the heap kept its top.

/// glibc keeps up to twice this much free memory at its heap's top (see
/// [`keep_freed_memory`]): twice what a QUIC stream's window was (1 MiB)
/// when this was measured. Under one
/// bulk stream over QUIC or HTTP/2, 2 MiB took page faults from 78,000 in
/// two seconds to none; 1 MiB left 50,000 under HTTP/2. An idle hub holds
/// about as much more memory per arena.
const KEEP: usize = 1024 * 1024;

/// Lets glibc's malloc keep up to 2 MiB of freed memory per arena instead
/// of 128 KiB.
///
/// glibc documents (mallopt(3), `M_MMAP_THRESHOLD`) that freeing a block it
/// had mapped on its own raises its mapping threshold to that block's size
/// and its trim threshold to twice that; one block of [`KEEP`], allocated
/// and freed, sets both, without reaching for `mallopt`. Blocks this large
/// or larger are still mapped on their own, so a large zeroed buffer is
/// not touched (and costs no memory) until used. Elsewhere (musl, another
/// allocator) this is one allocation and nothing more.
pub fn keep_freed_memory() {
    let block: Vec<u8> = Vec::with_capacity(KEEP);
    // Kept opaque, or the compiler may drop the allocation altogether.
    drop(std::hint::black_box(block));
}
