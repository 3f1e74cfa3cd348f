//! Process allocator settings for the forward pass.
//!
//! A forward pass allocates a few large buffers (activations of a block, a block's logits: 64 rows x 151,936 f32 is
//! 39 MB). With glibc's defaults, buffers above the mmap threshold (at most 32 MB) are fresh mappings every time, and
//! freed heap tops are trimmed: each step then pays page faults and the kernel zeroing every page again, a visible
//! share of a verification block's time. Loading a model raises both thresholds once, so large buffers come
//! from the heap and stay there for the next step; the process keeps its high-water mark of buffer memory, which is
//! what a serving process wants.

use std::sync::Once;

/// Keeps large buffers in the heap (glibc only; elsewhere nothing to do). Idempotent.
pub fn keep_large_buffers() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        #[allow(unsafe_code)]
        // SAFETY: mallopt only changes allocator thresholds; it is called once, before the buffers it affects.
        unsafe {
            let ok = libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1;
            if !ok {
                tracing::debug!(
                    "mallopt refused the buffer thresholds; keeping the allocator defaults"
                );
            }
        }
    });
}

/// Asks the kernel to back the whole 2 MB pages inside the `bytes` bytes at `at` (a weight matrix this process owns,
/// streamed whole at every step; only its address is used, nothing is read or written through it) with
/// transparent huge pages, now (`MADV_COLLAPSE`, Linux 6.1 and later) and for good (`MADV_HUGEPAGE`, for a kernel
/// whose THP setting is `madvise`, the common default). With 4 KB pages a step over a gigabyte of weights walks the
/// page tables a quarter of a million times, and the row groups' prefetches of the next rows can wait on those
/// walks. A kernel that refuses (no THP, too old, no memory to compact) leaves the pages as they are: the same bits
/// either way, only the speed differs.
pub fn huge_pages(at: *const u8, bytes: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const HUGE: usize = 2 << 20;
        if bytes < HUGE {
            return;
        }
        let start = (at as usize).next_multiple_of(HUGE);
        let end = (at as usize + bytes) / HUGE * HUGE;
        if end <= start {
            return;
        }
        #[allow(unsafe_code)]
        // SAFETY: the range lies inside the caller's allocation, memory this process owns and keeps mapped; both
        // advices change how the kernel backs the pages, never their contents.
        unsafe {
            let p = start as *mut libc::c_void;
            let hinted = libc::madvise(p, end - start, libc::MADV_HUGEPAGE) == 0;
            let collapsed = libc::madvise(p, end - start, libc::MADV_COLLAPSE) == 0;
            if !(hinted && collapsed) {
                tracing::debug!(
                    hinted,
                    collapsed,
                    "huge pages refused for {} MB of weights",
                    (end - start) >> 20
                );
            }
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (at, bytes);
}
