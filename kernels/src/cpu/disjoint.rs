//! [`Disjoint`]: the output buffer of a parallel op, which the threads of one pool run write
//! at disjoint indices (each thread its own rows); the matrix kernels of [`super::gemm`] and
//! [`super::lanes`] write their outputs through it.

/// An output buffer that the threads of one pool run write at disjoint indices.
///
/// Contract: during one [`ThreadPool::run`](crate::par::ThreadPool::run), every index (or
/// range) is written by at most one thread and nothing reads the buffer; the buffer outlives
/// the run.
pub(crate) struct Disjoint<T> {
    ptr: *mut T,
    len: usize,
}

/// [`Disjoint`] over f32 outputs.
pub(crate) type DisjointOut = Disjoint<f32>;
/// [`Disjoint`] over bytes (quantized activation rows).
pub(crate) type DisjointBytes = Disjoint<u8>;

// SAFETY: the type's contract makes concurrent writes target disjoint memory; `T: Send`
// values may be written from any thread.
unsafe impl<T: Send> Sync for Disjoint<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for Disjoint<T> {}

impl<T: Copy> Disjoint<T> {
    pub(crate) fn new(out: &mut [T]) -> Self {
        Disjoint { ptr: out.as_mut_ptr(), len: out.len() }
    }

    /// Writes element `i`.
    #[inline]
    pub(crate) fn set(&self, i: usize, v: T) {
        assert!(i < self.len, "output index out of range");
        // SAFETY: in bounds (checked above); only this thread writes index `i` (contract).
        unsafe { self.ptr.wrapping_add(i).write(v) }
    }

    /// The `len` elements at `start`, for a range only this thread writes.
    #[inline]
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.len, "output range out of bounds");
        // SAFETY: in bounds (checked above); the range belongs to this thread alone for the
        // duration of the run (contract), so no other reference to it exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.wrapping_add(start), len) }
    }
}
