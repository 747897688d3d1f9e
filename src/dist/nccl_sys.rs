//! NCCL loaded at run time: `libnccl.so.2` is opened with dlopen the first time a run on several GPUs needs
//! it, and the few functions the NCCL backend calls are resolved once, typed as in `nccl.h`. The `cuda` build
//! therefore does not link libnccl: it starts, and runs on one GPU or on the CPU, on a machine without NCCL;
//! a data-parallel run on GPUs without it stops with an error naming the library and what to install.
//! (cudarc's own NCCL bindings cannot be loaded this way: candle-core builds cudarc with `dynamic-linking`,
//! which excludes cudarc's `dynamic-loading`.)

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

/// The file names tried, in order: the runtime's soname, then the development link.
const LIBRARIES: [&CStr; 2] = [c"libnccl.so.2", c"libnccl.so"];

/// An NCCL communicator (`ncclComm_t`).
pub(super) type Comm = *mut c_void;

/// A CUDA stream (`cudaStream_t`, the driver's `CUstream`).
pub(super) type Stream = *mut c_void;

/// The length of NCCL's unique id (`NCCL_UNIQUE_ID_BYTES`).
pub(super) const ID_BYTES: usize = 128;

/// `ncclUniqueId`: passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct UniqueId {
    pub internal: [c_char; ID_BYTES],
}

/// `ncclDataType_t` (values of `nccl.h` since NCCL 2.0).
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(super) struct DataType(c_int);

impl DataType {
    pub const UINT8: Self = Self(1);
    pub const FLOAT32: Self = Self(7);
    pub const FLOAT64: Self = Self(8);
}

/// `ncclRedOp_t`.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(super) struct RedOp(c_int);

impl RedOp {
    pub const SUM: Self = Self(0);
    pub const MAX: Self = Self(2);
}

/// `ncclSuccess` and `ncclInProgress` (a non-blocking communicator's call still running) of `ncclResult_t`.
const SUCCESS: c_int = 0;
const IN_PROGRESS: c_int = 7;

/// A failed NCCL call, or NCCL that could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum NcclError {
    #[error("{0}")]
    Load(String),
    #[error("{call}: {message} (ncclResult_t {code})")]
    Call { call: &'static str, code: c_int, message: String },
}

// The C signatures of nccl.h.
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
type Reduce = unsafe extern "C" fn(*const c_void, *mut c_void, usize, DataType, RedOp, Comm, Stream) -> c_int;
type Gather = unsafe extern "C" fn(*const c_void, *mut c_void, usize, DataType, Comm, Stream) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(Comm, *mut c_int) -> c_int;
type CommEnd = unsafe extern "C" fn(Comm) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The functions resolved from the library. The handle is never closed: the functions live as long as the process.
struct Api {
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    all_reduce: Reduce,
    reduce_scatter: Reduce,
    all_gather: Gather,
    comm_get_async_error: CommGetAsyncError,
    comm_abort: CommEnd,
    comm_destroy: CommEnd,
    get_error_string: GetErrorString,
}

// SAFETY: plain function pointers into a library that stays loaded.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

/// What a run on several GPUs needs when NCCL cannot be loaded.
const INSTALL: &str = "a run on several GPUs needs NCCL 2 for CUDA 13: install it (Debian/Ubuntu with NVIDIA's CUDA \
     repository: `apt install libnccl2`; or `pip install nvidia-nccl-cu13` and add its nvidia/nccl/lib folder to \
     LD_LIBRARY_PATH); one GPU or the CPU needs no NCCL";

/// The last `dlerror()` message, or `fallback`.
fn dl_error(fallback: &str) -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call of this thread.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        fallback.to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// Open the first of `names` that loads, and resolve NCCL's functions in it.
fn open(names: &[&CStr]) -> Result<Api, NcclError> {
    let mut tried = Vec::new();
    let handle = names.iter().find_map(|name| {
        // SAFETY: a NUL-terminated file name; the flags are dlopen's.
        let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            tried.push(dl_error(&name.to_string_lossy()));
        }
        (!h.is_null()).then_some((h, *name))
    });
    let Some((handle, name)) = handle else {
        return Err(NcclError::Load(format!("cannot load NCCL ({}): {INSTALL}", tried.join("; "))));
    };
    let lib = name.to_string_lossy();
    let symbol = |s: &str| -> Result<*mut c_void, NcclError> {
        let c = CString::new(s).expect("a symbol name has no NUL");
        // SAFETY: a handle from dlopen and a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
        if p.is_null() {
            Err(NcclError::Load(format!(
                "{lib} has no {s} ({}): is it NCCL 2.4 or newer? {INSTALL}",
                dl_error("not found")
            )))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each symbol is the NCCL function of that name, whose C signature (nccl.h) the field's type spells.
    unsafe {
        Ok(Api {
            get_unique_id: std::mem::transmute::<*mut c_void, GetUniqueId>(symbol("ncclGetUniqueId")?),
            comm_init_rank: std::mem::transmute::<*mut c_void, CommInitRank>(symbol("ncclCommInitRank")?),
            all_reduce: std::mem::transmute::<*mut c_void, Reduce>(symbol("ncclAllReduce")?),
            reduce_scatter: std::mem::transmute::<*mut c_void, Reduce>(symbol("ncclReduceScatter")?),
            all_gather: std::mem::transmute::<*mut c_void, Gather>(symbol("ncclAllGather")?),
            comm_get_async_error: std::mem::transmute::<*mut c_void, CommGetAsyncError>(symbol(
                "ncclCommGetAsyncError",
            )?),
            comm_abort: std::mem::transmute::<*mut c_void, CommEnd>(symbol("ncclCommAbort")?),
            comm_destroy: std::mem::transmute::<*mut c_void, CommEnd>(symbol("ncclCommDestroy")?),
            get_error_string: std::mem::transmute::<*mut c_void, GetErrorString>(symbol("ncclGetErrorString")?),
        })
    }
}

/// NCCL's functions, loaded on first use (once per process; a failure is kept and returned again).
fn api() -> Result<&'static Api, NcclError> {
    static API: OnceLock<Result<Api, NcclError>> = OnceLock::new();
    API.get_or_init(|| open(&LIBRARIES)).as_ref().map_err(Clone::clone)
}

/// Load NCCL now, so that a missing library stops the run before any rank waits for another.
pub(super) fn load() -> Result<(), NcclError> {
    api().map(|_| ())
}

/// `code` of `call` as a result: success and "in progress" are Ok, anything else the error NCCL names.
fn check(api: &Api, call: &'static str, code: c_int) -> Result<(), NcclError> {
    if code == SUCCESS || code == IN_PROGRESS {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let message = unsafe { (api.get_error_string)(code) };
    let message = if message.is_null() {
        "unknown error".to_owned()
    } else {
        // SAFETY: non-null, static and NUL-terminated (above).
        unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
    };
    Err(NcclError::Call { call, code, message })
}

/// `ncclGetUniqueId`: a new id for a communicator (rank 0).
pub(super) fn get_unique_id() -> Result<UniqueId, NcclError> {
    let api = api()?;
    let mut id = UniqueId { internal: [0; ID_BYTES] };
    // SAFETY: a pointer to a writable ncclUniqueId.
    check(api, "ncclGetUniqueId", unsafe { (api.get_unique_id)(&mut id) })?;
    Ok(id)
}

/// `ncclCommInitRank`.
///
/// # Safety
/// `comm` points to writable memory for a communicator.
pub(super) unsafe fn comm_init_rank(
    comm: *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> Result<(), NcclError> {
    let api = api()?;
    check(api, "ncclCommInitRank", (api.comm_init_rank)(comm, nranks, id, rank))
}

/// `ncclAllReduce` of `count` elements.
///
/// # Safety
/// `send` and `recv` are device buffers of `count` elements of `dtype`, valid until the stream has run the
/// collective; `comm` is a live communicator.
pub(super) unsafe fn all_reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: DataType,
    op: RedOp,
    comm: Comm,
    stream: Stream,
) -> Result<(), NcclError> {
    let api = api()?;
    check(api, "ncclAllReduce", (api.all_reduce)(send, recv, count, dtype, op, comm, stream))
}

/// `ncclReduceScatter`: `recv_count` elements to each rank.
///
/// # Safety
/// `send` holds ranks x `recv_count` and `recv` `recv_count` elements of `dtype` on the device, valid until the
/// stream has run the collective; `comm` is a live communicator.
pub(super) unsafe fn reduce_scatter(
    send: *const c_void,
    recv: *mut c_void,
    recv_count: usize,
    dtype: DataType,
    op: RedOp,
    comm: Comm,
    stream: Stream,
) -> Result<(), NcclError> {
    let api = api()?;
    check(api, "ncclReduceScatter", (api.reduce_scatter)(send, recv, recv_count, dtype, op, comm, stream))
}

/// `ncclAllGather`: `send_count` elements from each rank.
///
/// # Safety
/// `send` holds `send_count` and `recv` ranks x `send_count` elements of `dtype` on the device, valid until the
/// stream has run the collective; `comm` is a live communicator.
pub(super) unsafe fn all_gather(
    send: *const c_void,
    recv: *mut c_void,
    send_count: usize,
    dtype: DataType,
    comm: Comm,
    stream: Stream,
) -> Result<(), NcclError> {
    let api = api()?;
    check(api, "ncclAllGather", (api.all_gather)(send, recv, send_count, dtype, comm, stream))
}

/// `ncclCommGetAsyncError`: the communicator's asynchronous error (another rank failed, the network broke), if any.
///
/// # Safety
/// `comm` is a live communicator.
pub(super) unsafe fn comm_get_async_error(comm: Comm) -> Result<(), NcclError> {
    let api = api()?;
    let mut error = SUCCESS;
    check(api, "ncclCommGetAsyncError", (api.comm_get_async_error)(comm, &mut error))?;
    check(api, "asynchronous error", error)
}

/// `ncclCommAbort`.
///
/// # Safety
/// `comm` is a live communicator, not used afterwards.
pub(super) unsafe fn comm_abort(comm: Comm) -> Result<(), NcclError> {
    let api = api()?;
    check(api, "ncclCommAbort", (api.comm_abort)(comm))
}

/// `ncclCommDestroy`.
///
/// # Safety
/// `comm` is a live communicator, not used afterwards.
pub(super) unsafe fn comm_destroy(comm: Comm) -> Result<(), NcclError> {
    let api = api()?;
    check(api, "ncclCommDestroy", (api.comm_destroy)(comm))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_itself_and_what_to_install() {
        let Err(NcclError::Load(message)) = open(&[c"libnccl-absent-for-test.so.2"]) else {
            panic!("a library that does not exist loaded");
        };
        assert!(message.contains("libnccl-absent-for-test.so.2"), "{message}");
        assert!(message.contains("libnccl2") && message.contains("nvidia-nccl-cu13"), "{message}");
        assert!(message.contains("one GPU or the CPU needs no NCCL"), "{message}");
    }

    #[test]
    fn a_library_without_nccl_names_the_missing_function() {
        // The C library loads but has none of NCCL's functions.
        let Err(NcclError::Load(message)) = open(&[c"libc.so.6"]) else {
            panic!("libc resolved as NCCL");
        };
        assert!(message.contains("libc.so.6 has no ncclGetUniqueId"), "{message}");
    }

    #[test]
    fn the_id_is_passed_as_ncclh_lays_it_out() {
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
        assert_eq!(std::mem::size_of::<DataType>(), std::mem::size_of::<c_int>());
        assert_eq!(std::mem::size_of::<RedOp>(), std::mem::size_of::<c_int>());
    }
}
