//! A scripted HTTP server for the engine's and the rollout server's tests: a thread on a loopback port
//! that answers its connections in turn, one [`Reply`] each, and records what it received and wrote.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::Duration;

/// What the server does with one connection, after reading its request.
pub enum Reply {
    /// A complete response with this status and JSON body.
    Full(u16, String),
    /// A 200 announcing a body of this many bytes (a completion whose text never ends), written until
    /// the client goes away.
    Endless(u64),
    /// A 200's headers announcing a body, then nothing until the client goes away.
    Stall,
}

/// What happened on one connection: the request's body and the response body's bytes written.
#[derive(Debug)]
pub struct Exchange {
    pub request: String,
    pub written: u64,
}

/// A server answering its connections with `replies`, in order, then stopping. Returns its base URL
/// (`http://127.0.0.1:PORT/v1`) and the thread, which gives each connection's [`Exchange`].
pub fn serve(replies: Vec<Reply>) -> (String, JoinHandle<Vec<Exchange>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let thread = std::thread::spawn(move || {
        replies
            .into_iter()
            .map(|reply| {
                let (stream, _) = listener.accept().unwrap();
                // Nothing in a test waits longer: a client that never goes away cannot hang the thread.
                stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                stream.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
                answer(stream, reply)
            })
            .collect()
    });
    (url, thread)
}

fn answer(stream: TcpStream, reply: Reply) -> Exchange {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let request = read_request(&mut reader);
    let mut out = stream;
    let head = |status: u16, len: u64| {
        format!("HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
    };
    let written = match reply {
        Reply::Full(status, body) => {
            out.write_all(head(status, body.len() as u64).as_bytes()).unwrap();
            out.write_all(body.as_bytes()).map_or(0, |_| body.len() as u64)
        }
        Reply::Endless(len) => {
            out.write_all(head(200, len).as_bytes()).unwrap();
            let start = br#"{"choices":[{"index":0,"text":""#;
            let chunk = "many words ".repeat(6000);
            let mut written = out.write_all(start).map_or(0, |_| start.len() as u64);
            while written < len && out.write_all(chunk.as_bytes()).is_ok() {
                written += chunk.len() as u64;
            }
            written
        }
        Reply::Stall => {
            out.write_all(head(200, 1000).as_bytes()).unwrap();
            let _ = out.flush();
            // Until the client closes the connection (or the read timeout).
            let _ = reader.read(&mut [0u8; 64]);
            0
        }
    };
    Exchange { request, written }
}

/// The body of the HTTP request on `reader` (its headers read and dropped).
fn read_request(reader: &mut BufReader<TcpStream>) -> String {
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).unwrap();
    String::from_utf8(body).unwrap()
}
