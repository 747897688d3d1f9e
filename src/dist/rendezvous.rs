//! The rendezvous of a launch without MPI (torchrun): rank 0 listens at MASTER_ADDR:MASTER_PORT, each other
//! rank connects and sends its message (its readiness for NCCL), and once every rank has come rank 0 sends
//! each of them every rank's message (its own carries NCCL's 128-byte unique id): an all-gather through rank
//! 0 before the communicator exists. Every wait is bounded, so a rank that never comes is an error naming
//! it rather than a hang.

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

/// Rank 0 of `size` ranks: listen on `port` (all interfaces), receive every other rank's message and, once
/// all have come, send every rank all the messages (`mine` first): an all-gather through rank 0.
pub fn serve(port: u16, mine: &[u8], size: usize, timeout: Duration) -> Result<Vec<Vec<u8>>, RendezvousError> {
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|source| RendezvousError::Listen { port, source })?;
    serve_on(&listener, mine, size, timeout)
}

/// How long rank 0 waits for a connected rank to say which it is: a connection silent for longer (a port
/// scanner, a health check, a stray client) is dropped, and never holds up the ranks behind it.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// [`serve`] on a bound listener. Each connection's message is read on its own thread, bounded by
/// [`HELLO_TIMEOUT`], so a silent connection stalls nothing; the answers go out once every rank has come.
fn serve_on(
    listener: &TcpListener,
    mine: &[u8],
    size: usize,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>, RendezvousError> {
    let port = listener.local_addr().map_or(0, |a| a.port());
    let io = |source| RendezvousError::Io { addr: format!("port {port}"), source };
    listener.set_nonblocking(true).map_err(io)?;
    let deadline = Instant::now() + timeout;
    let mut came: Vec<Option<(Vec<u8>, TcpStream)>> = (0..size).map(|_| None).collect();
    let (heard, hellos) = std::sync::mpsc::channel::<(usize, Vec<u8>, TcpStream)>();
    let missing = |came: &[Option<_>]| -> Vec<usize> { (1..size).filter(|&r| came[r].is_none()).collect() };
    while !missing(&came).is_empty() {
        while let Ok((rank, message, stream)) = hellos.try_recv() {
            if rank > 0 && rank < size {
                came[rank] = Some((message, stream));
            }
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                let heard = heard.clone();
                let hello = HELLO_TIMEOUT.min(deadline.saturating_duration_since(Instant::now())).max(ONE_MS);
                std::thread::spawn(move || match read_hello(stream, hello) {
                    Ok((rank, message, stream)) => {
                        let _ = heard.send((rank, message, stream));
                    }
                    Err(e) => tracing::warn!("rendezvous: ignored a connection from {peer}: {e}"),
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    std::thread::sleep(Duration::from_millis(50));
                    while let Ok((rank, message, stream)) = hellos.try_recv() {
                        if rank > 0 && rank < size {
                            came[rank] = Some((message, stream));
                        }
                    }
                    let missing = missing(&came);
                    if missing.is_empty() {
                        break;
                    }
                    return Err(RendezvousError::Missing { port, missing, timeout });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(io(e)),
        }
    }
    let mut all = vec![mine.to_vec()];
    let mut streams = Vec::new();
    for (message, stream) in came.into_iter().skip(1).flatten() {
        all.push(message);
        streams.push(stream);
    }
    let answer = encode_all(&all);
    for mut stream in streams {
        let peer = stream.peer_addr().map_or_else(|_| "a rank".to_string(), |a| a.to_string());
        stream.write_all(&answer).map_err(|source| RendezvousError::Io { addr: peer, source })?;
    }
    Ok(all)
}

/// Read a connected rank's number and message (within `hello`).
fn read_hello(mut stream: TcpStream, hello: Duration) -> std::io::Result<(usize, Vec<u8>, TcpStream)> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(hello))?;
    stream.set_write_timeout(Some(hello))?;
    let rank = read_u64(&mut stream)? as usize;
    let message = read_bytes(&mut stream)?;
    Ok((rank, message, stream))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// A length (u64) and that many bytes, at most [`MAX_MESSAGE`].
fn read_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = read_u64(r)?;
    if n > MAX_MESSAGE {
        return Err(std::io::Error::other(format!("a message of {n} bytes (at most {MAX_MESSAGE})")));
    }
    let mut b = vec![0u8; n as usize];
    r.read_exact(&mut b)?;
    Ok(b)
}

/// The largest message a rank sends through the rendezvous.
const MAX_MESSAGE: u64 = 1 << 20;

/// The messages, counted, each with its length.
fn encode_all(all: &[Vec<u8>]) -> Vec<u8> {
    let mut out = (all.len() as u64).to_le_bytes().to_vec();
    for m in all {
        out.extend_from_slice(&(m.len() as u64).to_le_bytes());
        out.extend_from_slice(m);
    }
    out
}

const ONE_MS: Duration = Duration::from_millis(1);

/// Rank `rank` (not 0): connect to rank 0 at `addr:port`, retrying until `timeout` (it may not listen yet),
/// send `mine` and receive every rank's message, in rank order, once all have come.
pub fn join(
    addr: &str,
    port: u16,
    rank: usize,
    mine: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>, RendezvousError> {
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
    // Rank 0 answers once every rank has come, within the timeout (and a moment to send).
    let wait = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(5);
    stream.set_read_timeout(Some(wait)).map_err(io)?;
    let mut hello = (rank as u64).to_le_bytes().to_vec();
    hello.extend_from_slice(&(mine.len() as u64).to_le_bytes());
    hello.extend_from_slice(mine);
    stream.write_all(&hello).map_err(io)?;
    let closed = |source: std::io::Error| match source.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => RendezvousError::Io {
            addr: format!("{addr}:{port}"),
            source: std::io::Error::other("rank 0 ended the rendezvous without answering (see rank 0's error)"),
        },
        _ => io(source),
    };
    let count = read_u64(&mut stream).map_err(closed)?;
    (0..count).map(|_| read_bytes(&mut stream).map_err(closed)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join_in(
        port: u16,
        rank: usize,
        mine: &'static [u8],
        timeout: Duration,
    ) -> std::thread::JoinHandle<Vec<Vec<u8>>> {
        std::thread::spawn(move || join("127.0.0.1", port, rank, mine, timeout).unwrap())
    }

    #[test]
    fn every_rank_receives_every_message_once_all_have_come() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let ranks: Vec<_> = [(1, &b"one"[..]), (2, &b""[..])]
            .into_iter()
            .map(|(r, m)| join_in(port, r, m, Duration::from_secs(20)))
            .collect();
        // Rank 0 listens only after the others first tried: they retry.
        std::thread::sleep(Duration::from_millis(300));
        let all = serve_on(&listener, b"id", 3, Duration::from_secs(20)).unwrap();
        let want = vec![b"id".to_vec(), b"one".to_vec(), Vec::new()];
        assert_eq!(all, want);
        for r in ranks {
            assert_eq!(r.join().unwrap(), want);
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
            join("127.0.0.1", port, 1, b"x", Duration::from_secs(30)).unwrap()
        });
        let t = Instant::now();
        serve_on(&listener, b"abcd", 2, Duration::from_secs(30)).unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "served after {:?}", t.elapsed());
        assert_eq!(one.join().unwrap(), vec![b"abcd".to_vec(), b"x".to_vec()]);
    }

    #[test]
    fn a_rank_that_never_comes_is_named_in_bounded_time() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let one = std::thread::spawn(move || join("127.0.0.1", port, 1, b"x", Duration::from_secs(20)));
        let t = Instant::now();
        let e = serve_on(&listener, b"abcd", 3, Duration::from_millis(500)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(matches!(&e, RendezvousError::Missing { missing, .. } if missing == &[2]), "{e}");
        // The rank that came is not left waiting: rank 0's end of the rendezvous reaches it.
        drop(listener);
        let e1 = one.join().unwrap().unwrap_err().to_string();
        assert!(e1.contains("rank 0 ended the rendezvous"), "{e1}");
        assert!(t.elapsed() < Duration::from_secs(5));
        // Nobody listens: the error names the address and the rank.
        let e = join("127.0.0.1", port, 2, b"x", Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains(&format!("127.0.0.1:{port}")) && e.starts_with("rank 2"), "{e}");
    }
}
