//! The rendezvous of a launch without MPI (torchrun): rank 0 listens at MASTER_ADDR:MASTER_PORT and sends
//! one payload (NCCL's 128-byte unique id) to each rank that connects. One message per rank before the
//! communicator exists, not a collective; every wait is bounded, so a rank that never comes is an error
//! naming it rather than a hang.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Why the ranks could not meet.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank 0 cannot listen on port {port} (MASTER_PORT): {source}")]
    Listen { port: u16, source: std::io::Error },
    #[error("rank 0: ranks {missing:?} did not connect to port {port} within {timeout:?}")]
    Missing { port: u16, missing: Vec<usize>, timeout: Duration },
    #[error("rank {rank}: cannot reach rank 0 at {addr}:{port} (MASTER_ADDR:MASTER_PORT) within {timeout:?}: {last}")]
    Unreachable { rank: usize, addr: String, port: u16, timeout: Duration, last: String },
    #[error("rendezvous at {addr}: {source}")]
    Io { addr: String, source: std::io::Error },
}

/// Rank 0 of `size` ranks: listen on `port` (all interfaces) and send `payload` to every other rank.
pub fn serve(port: u16, payload: &[u8], size: usize, timeout: Duration) -> Result<(), RendezvousError> {
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|source| RendezvousError::Listen { port, source })?;
    serve_on(&listener, payload, size, timeout)
}

/// How long rank 0 waits for a connected rank to say which it is: a connection silent for longer (a port
/// scanner, a health check, a stray client) is dropped, and never holds up the ranks behind it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// [`serve`] on a bound listener. Each connection is answered on its own thread, bounded by
/// [`HELLO_TIMEOUT`], so a silent connection stalls nothing.
fn serve_on(listener: &TcpListener, payload: &[u8], size: usize, timeout: Duration) -> Result<(), RendezvousError> {
    let port = listener.local_addr().map_or(0, |a| a.port());
    let io = |source| RendezvousError::Io { addr: format!("port {port}"), source };
    listener.set_nonblocking(true).map_err(io)?;
    let deadline = Instant::now() + timeout;
    let mut waiting: BTreeSet<usize> = (1..size).collect();
    let (served, answers) = std::sync::mpsc::channel::<usize>();
    while !waiting.is_empty() {
        while let Ok(rank) = answers.try_recv() {
            waiting.remove(&rank);
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                let (served, payload) = (served.clone(), payload.to_vec());
                let hello = HELLO_TIMEOUT.min(deadline.saturating_duration_since(Instant::now())).max(ONE_MS);
                std::thread::spawn(move || match answer(stream, &payload, hello) {
                    Ok(rank) => {
                        let _ = served.send(rank);
                    }
                    Err(e) => tracing::warn!("rendezvous: ignored a connection from {peer}: {e}"),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    while let Ok(rank) = answers.try_recv() {
                        waiting.remove(&rank);
                    }
                    if waiting.is_empty() {
                        break;
                    }
                    return Err(RendezvousError::Missing { port, missing: waiting.into_iter().collect(), timeout });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(io(e)),
        }
    }
    Ok(())
}

/// Read a connected rank's number (within `hello`) and send it the payload.
fn answer(mut stream: TcpStream, payload: &[u8], hello: Duration) -> std::io::Result<usize> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(hello))?;
    stream.set_write_timeout(Some(hello))?;
    let mut rank = [0u8; 8];
    stream.read_exact(&mut rank)?;
    stream.write_all(payload)?;
    Ok(u64::from_le_bytes(rank) as usize)
}

const ONE_MS: Duration = Duration::from_millis(1);

/// Rank `rank` (not 0): connect to rank 0 at `addr:port`, retrying until `timeout` (it may not listen yet),
/// and receive its `len`-byte payload.
pub fn fetch(addr: &str, port: u16, rank: usize, len: usize, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
    let deadline = Instant::now() + timeout;
    let unreachable = |last: String| RendezvousError::Unreachable { rank, addr: addr.into(), port, timeout, last };
    let mut stream = loop {
        let attempt = (addr, port).to_socket_addrs().and_then(|mut addrs| {
            let a = addrs.next().ok_or_else(|| std::io::Error::other("the name resolves to no address"))?;
            TcpStream::connect_timeout(&a, Duration::from_secs(2))
        });
        match attempt {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => return Err(unreachable(e.to_string())),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let io = |source| RendezvousError::Io { addr: format!("{addr}:{port}"), source };
    stream.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(ONE_MS))).map_err(io)?;
    stream.write_all(&(rank as u64).to_le_bytes()).map_err(io)?;
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).map_err(io)?;
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_zero_sends_its_payload_to_every_rank() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let id: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
        let ranks: Vec<_> = (1..3)
            .map(|r| std::thread::spawn(move || fetch("127.0.0.1", port, r, 128, Duration::from_secs(20)).unwrap()))
            .collect();
        // Rank 0 listens only after the others first tried: they retry.
        std::thread::sleep(Duration::from_millis(300));
        serve_on(&listener, &id, 3, Duration::from_secs(20)).unwrap();
        for r in ranks {
            assert_eq!(r.join().unwrap(), id);
        }
    }

    #[test]
    fn a_silent_connection_does_not_stall_the_ranks_behind_it() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        // A client that connects and says nothing (a port scanner, a health check), before the rank.
        let _stray = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let one = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            fetch("127.0.0.1", port, 1, 4, Duration::from_secs(30)).unwrap()
        });
        let t = Instant::now();
        serve_on(&listener, b"abcd", 2, Duration::from_secs(30)).unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "served after {:?}", t.elapsed());
        assert_eq!(one.join().unwrap(), b"abcd");
    }

    #[test]
    fn a_rank_that_never_comes_is_named_in_bounded_time() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let one = std::thread::spawn(move || fetch("127.0.0.1", port, 1, 4, Duration::from_secs(20)).unwrap());
        let t = Instant::now();
        let e = serve_on(&listener, b"abcd", 3, Duration::from_millis(500)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(one.join().unwrap(), b"abcd");
        assert!(matches!(&e, RendezvousError::Missing { missing, .. } if missing == &[2]), "{e}");
        // Nobody listens: the error names the address and the rank.
        drop(listener);
        let e = fetch("127.0.0.1", port, 2, 4, Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains(&format!("127.0.0.1:{port}")) && e.starts_with("rank 2"), "{e}");
    }
}
