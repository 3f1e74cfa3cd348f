//! Process allocator settings for the forward pass.
//!
//! A forward pass allocates a few large buffers (activations of a block, a block's logits: 64 rows x 151,936 f32 is
//! 39 MB). With glibc's defaults, buffers above the mmap threshold (at most 32 MB) are fresh mappings every time, and
//! freed heap tops are trimmed: each step then pays page faults and the kernel zeroing every page again (measured at
//! 8% of a 64-token block of the default target). Loading a model raises both thresholds once, so large buffers come
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
