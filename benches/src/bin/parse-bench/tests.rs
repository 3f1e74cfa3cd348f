use super::*;

fn reference_tokenizer() -> Tokenizer {
    Tokenizer::from_file(&parse_bench::reference_tokenizer_path())
        .expect("the reference tokenizer (assets/tokenizer)")
}

#[test]
fn humaneval_output_is_kept_up_to_the_close_of_the_first_code_block() {
    let tok = reference_tokenizer();
    let head = tok.encode("```python\ndef f(x):\n    return x\n").unwrap();
    let close = tok.encode("```").unwrap();
    let prose = tok
        .encode("\n\nThis function returns its argument.")
        .unwrap();
    let mut end = AnswerEnd::new(&tok, true);
    // The draft writes the head, the target the fence and, in the same chunk, prose that must not count.
    assert!(end.push(&head, Source::Draft));
    let tail: Vec<u32> = close.iter().chain(&prose).copied().collect();
    assert!(!end.push(&tail, Source::Target));
    assert_eq!(end.kept.len(), head.len() + close.len());
    assert_eq!(end.from_draft, head.len());
    assert!(
        !end.push(&prose, Source::Draft),
        "nothing is kept after the end"
    );
    assert_eq!(end.kept.len(), head.len() + close.len());
    let code = code_of(&tok.decode(&end.kept, true).unwrap());
    assert_eq!(code, "\ndef f(x):\n    return x\n");

    // Other suites keep everything the loop emits.
    let mut all = AnswerEnd::new(&tok, false);
    assert!(all.push(&tail, Source::Draft));
    assert_eq!((all.kept.len(), all.from_draft), (tail.len(), tail.len()));
}

#[test]
fn rouge_l_counts_the_longest_common_subsequence() {
    assert_eq!(rouge_l(&[1, 2, 3, 4], &[1, 2, 3, 4]), 1.0);
    assert_eq!(rouge_l(&[1, 2, 3], &[4, 5]), 0.0);
    // LCS [1, 3, 4] of 4 and 5 tokens: P = 3/5, R = 3/4, F1 = 2/3.
    let f = rouge_l(&[1, 2, 3, 4], &[1, 3, 9, 4, 9]);
    assert!((f - 2.0 / 3.0).abs() < 1e-12, "{f}");
    assert_eq!(rouge_l(&[], &[]), 1.0);
    assert_eq!(rouge_l(&[1], &[]), 0.0);
}

#[test]
fn repetitions_give_a_mean_and_its_95_percent_interval() {
    // Mean 1.0, sample standard deviation 0.1 over 4 values: half-width t(3) * 0.1 / 2.
    let (mean, half) = mean_and_ci95(&[0.9, 1.1, 0.9, 1.1]);
    let sd = (4.0 * 0.01 / 3.0f64).sqrt();
    assert!((mean - 1.0).abs() < 1e-12, "{mean}");
    assert!((half - 3.182 * sd / 2.0).abs() < 1e-9, "{half}");
    // Identical values: no spread.
    assert_eq!(mean_and_ci95(&[1.2, 1.2, 1.2]), (1.2, 0.0));
    // One value: no interval.
    let (m, h) = mean_and_ci95(&[0.97]);
    assert_eq!(m, 0.97);
    assert!(h.is_nan());
    // Past the table the interval keeps shrinking with n.
    let wide: Vec<f64> = (0..31)
        .map(|i| if i % 2 == 0 { 0.9 } else { 1.1 })
        .collect();
    let wider: Vec<f64> = (0..41)
        .map(|i| if i % 2 == 0 { 0.9 } else { 1.1 })
        .collect();
    assert!(mean_and_ci95(&wider).1 < mean_and_ci95(&wide).1);
}

#[test]
fn cpu_per_token_is_set_against_the_same_repetitions_target_cell() {
    let mut rows = vec![
        json!({ "run": "target", "cpu_ms_per_token": 40.0, "cpu_ms_per_token_by_repeat": [40.0, 40.0] }),
        json!({ "run": "parse", "cpu_ms_per_token": 45.0, "cpu_ms_per_token_by_repeat": [50.0, 40.0] }),
    ];
    let md = cpu_table(&mut rows, &["127.0.0.1:8000".to_string()]);
    assert!(md.contains("127.0.0.1:8000"), "{md}");
    assert!(
        md.contains("| parse | 45.00 | 0.889 | 0.800, 1.000 | 0.900 |"),
        "{md}"
    );
    let by: Vec<f64> = rows[1]["cpu_x_target_by_repeat"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(by, vec![0.8, 1.0]);
    assert_eq!(rows[0]["cpu_x_target"], json!(1.0));
}

#[test]
fn a_row_reads_its_repetitions() {
    let row = json!({ "tokens_per_s_by_repeat": [30.0, 32.5] });
    assert_eq!(tps_by_repeat(&row), vec![30.0, 32.5]);
    assert!(tps_by_repeat(&json!({})).is_empty());
}
