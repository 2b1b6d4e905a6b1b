//! `atmost receipt verify`: a receipt checked offline.

/// `atmost receipt verify`: the verdict's exit code.
pub fn verify(keys: &std::path::Path, attempt: &str) -> std::process::ExitCode {
    use atmost::receipts::{Verdict, verify_json};
    use std::io::Read;
    let input = match attempt {
        "-" => {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text).map(|_| text)
        }
        path => std::fs::read_to_string(path),
    };
    let verdict = input
        .map_err(|e| format!("{attempt}: {e}"))
        .and_then(|text| {
            let pem =
                std::fs::read_to_string(keys).map_err(|e| format!("{}: {e}", keys.display()))?;
            verify_json(&text, &pem)
        });
    match verdict.map(|c| (c.verdict, c.tenant)) {
        Ok((Verdict::Verified, tenant)) => {
            println!("VERIFIED");
            // What the signature proves about whose permit it was.
            match tenant {
                Some(t) if t.is_empty() => {
                    eprintln!("atmost: signed in version 2, tenant \"\" (dev mode, no keys)")
                }
                Some(t) => eprintln!("atmost: signed in version 2, tenant {t:?}"),
                None => eprintln!(
                    "atmost: signed in version 1, which signs no tenant: it proves nothing about whose permit the receipt came from"
                ),
            }
            std::process::ExitCode::SUCCESS
        }
        Ok((Verdict::Forged, _)) => {
            println!("FORGED");
            std::process::ExitCode::from(1)
        }
        Ok((Verdict::UnknownKey, _)) => {
            println!("UNKNOWN_KEY");
            std::process::ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("atmost: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
